"""LoRA on any architecture (model.lora_targets) and the LoRA critic (model.critic_lora_r),
issue #26: which layers get adapters, the errors that name the field, the critic's frozen
16-bit backbone, its memory, and a resume that is bit for bit the run never stopped."""

import pytest
import torch
from safetensors.torch import load_file

from rlhflab import models as M
from rlhflab.config import ConfigError, load_config
from rlhflab.diagnostics.memory import cast_memory
from rlhflab.experience.cast import build_cast
from rlhflab.infra.runlog import read_jsonl
from rlhflab.trainers.ppo import PPOTrainer
from tests.test_ppo import VOLATILE, make_cfg


def tiny_lm(kind: str):
    """A one-layer causal LM of ``kind`` from its config alone (no weights file)."""
    import transformers as T

    common = {"vocab_size": 64}
    layered = {"num_hidden_layers": 1, "num_attention_heads": 2, "hidden_size": 16}
    configs = {
        "gpt2": lambda: T.GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=32, **common),
        "gpt_neox": lambda: T.GPTNeoXConfig(intermediate_size=32, **layered, **common),
        "phi": lambda: T.PhiConfig(intermediate_size=32, **layered, **common),
        "falcon": lambda: T.FalconConfig(**layered, **common),
        "qwen2": lambda: T.Qwen2Config(
            intermediate_size=32, num_key_value_heads=1, **layered, **common
        ),
    }
    torch.manual_seed(0)
    return M.disable_dropout(T.AutoModelForCausalLM.from_config(configs[kind]()).eval())


def adapted(model) -> set[str]:
    """Paths (in the unwrapped model) of the layers that carry a LoRA adapter."""
    prefix = "base_model.model."
    return {
        n[len(prefix) : -len(".lora_A")] for n, _ in model.named_modules() if n.endswith("lora_A")
    }


@pytest.mark.parametrize("kind", ["gpt2", "gpt_neox", "phi", "falcon", "qwen2"])
def test_all_linear_adapts_every_linear_layer_but_the_output_head(kind):
    lm = tiny_lm(kind)
    layers = set(M.linear_layers(lm))
    ids = torch.randint(0, 64, (2, 6))
    before = lm(input_ids=ids).logits
    lora = M.apply_lora(lm, 2, 4.0, "all-linear")  # the default of model.lora_targets
    assert adapted(lora) == layers - {"lm_head"} and len(layers) >= 5
    assert torch.equal(lora(input_ids=ids).logits, before)  # lora_B starts at zero
    # a trained adapter acts as the merged weight would: GPT-2's Conv1D layers keep their
    # weight transposed, and a wrong fan_in_fan_out would merge it the wrong way round
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
        unmerged = lora(input_ids=ids).logits
        lora.merge_adapter()
        merged = lora(input_ids=ids).logits
    assert not torch.allclose(unmerged, before, atol=1e-3)
    torch.testing.assert_close(merged, unmerged, rtol=1e-4, atol=1e-5)


def test_a_target_that_matches_no_layer_is_refused_with_the_model_s_layer_names():
    llama_names = ["q_proj", "k_proj", "v_proj", "o_proj"]
    with pytest.raises(M.ModelLoadError) as err:
        M.apply_lora(tiny_lm("gpt2"), 2, 4.0, llama_names)
    text = str(err.value)
    assert text.startswith("model.lora_targets: ['q_proj', 'k_proj', 'v_proj', 'o_proj']")
    assert "gpt2 model" in text and "['c_attn', 'c_fc', 'c_proj', 'lm_head']" in text
    # one good name does not hide a misspelt one (peft would adapt c_attn and say nothing)
    with pytest.raises(M.ModelLoadError, match=r"\['v_prj'\] match no Linear layer"):
        M.apply_lora(tiny_lm("qwen2"), 2, 4.0, ["q_proj", "v_prj"])


def test_the_old_attention_targets_still_adapt_exactly_those_layers():
    path = M.resolve_path("preset:nano")
    tok = M.load_tokenizer(path)
    names = ["q_proj", "k_proj", "v_proj", "o_proj"]  # the default before issue #26
    lora = M.apply_lora(M.load_causal_lm(path, tok), 2, 4.0, names)
    assert {n.rsplit(".", 1)[-1] for n in adapted(lora)} == set(names)
    everything = M.apply_lora(M.load_causal_lm(path, tok), 2, 4.0, "all-linear")
    assert {n.rsplit(".", 1)[-1] for n in adapted(everything)} == {
        *names,
        "gate_proj",
        "up_proj",
        "down_proj",
    }


@pytest.mark.parametrize(
    "overrides, stage, message",
    [
        (["model.lora_targets=q_proj"], "ppo", "model.lora_targets: 'q_proj': a single string"),
        (["model.lora_targets=[]"], "ppo", "model.lora_targets: empty"),
        (["model.critic_lora_r=4", "model.value_model=shared"], "ppo", "model.critic_lora_r:"),
        (["model.lora_r=4"], "sft", "model.lora_r: rlhflab sft trains every weight"),
        (["model.critic_lora_r=4"], "rm", "model.lora_r: rlhflab rm trains every weight"),
        (["model.critic_lora_r=4", "model.runtime=native"], "ppo", "model.runtime: 'native'"),
        # refused at config time (it was found only once the policy had loaded)
        (["model.lora_r=4", "model.reference_precision=bf16"], "ppo", "model.reference_precision"),
        (["model.lora_r=4", "model.reference_precision=int8"], "dpo", "model.reference_precision"),
    ],
)
def test_lora_settings_that_cannot_work_are_refused_naming_the_field(overrides, stage, message):
    base = {"reward": {"functions": {"rlhflab.builtin.toy_rewards:vowel_reward": 1.0}}}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(base=base, overrides=overrides, stage=stage)


def cast_config(**over):
    base = {"model": {"policy": "preset:nano"}, "device": "cpu"}
    return load_config(base=base, overrides=[f"{k}={v}" for k, v in over.items()])


def test_lora_with_offload_frozen_offloads_the_reward_model_only(nano_rm):
    """model.offload_frozen with LoRA was refused ("cannot be cast"), although the
    adapter-disabled reference has nothing to offload and the reward model can be."""
    cast = build_cast(
        cast_config(
            **{"model.lora_r": 4, "model.offload_frozen": "true", "reward.model": str(nano_rm)}
        )
    )
    assert isinstance(cast.reference, M.LoraReference)
    ((source, _),) = cast.reward.sources
    assert isinstance(source.model, M.Offloaded)


def test_a_lora_critic_trains_adapters_and_head_on_a_frozen_16_bit_backbone():
    over = {"reward.functions": "{'rlhflab.builtin.toy_rewards:vowel_reward': 1.0}"}
    full = build_cast(cast_config(**over, **{"model.value_model": "separate"}))
    cast = build_cast(
        cast_config(
            **over,
            **{
                "model.value_model": "separate",
                "model.critic_lora_r": 4,
                "model.reference_precision": "bf16",
            },
        )
    )
    named = dict(cast.critic.named_parameters())
    trained = {n: p for n, p in named.items() if p.requires_grad}
    frozen = {n: p for n, p in named.items() if not p.requires_grad}
    assert trained and all("lora_" in n or "modules_to_save" in n for n in trained)
    assert all(p.dtype == torch.float32 for p in trained.values())
    backbone = {n: p for n, p in frozen.items() if ".score." not in n}
    assert backbone and all(p.dtype == torch.bfloat16 for p in backbone.values())
    ids = torch.randint(5, 200, (2, 7))
    values = cast.critic_values(ids, torch.ones_like(ids))
    assert values.dtype == torch.float32 and torch.equal(values, torch.zeros(2, 7))  # zero head
    # the policy is untouched: a full model, and its reference a bf16 copy
    assert not any(p.dtype != torch.float32 for p in cast.policy.parameters())

    lora_row = next(m for m in cast_memory(cast) if m.name == "critic")
    full_row = next(m for m in cast_memory(full) if m.name == "critic")
    trained_bytes = sum(p.numel() * 4 for p in trained.values())
    assert lora_row.trainable == lora_row.gradients == trained_bytes
    assert lora_row.optimizer == 2 * trained_bytes
    # the backbone at 2 bytes a weight, the adapters and head (head and its trained copy) at 4
    expect = sum(p.numel() * (2 if p.dtype == torch.bfloat16 else 4) for p in named.values())
    assert lora_row.weights == expect < full_row.weights
    # no gradients or moments for the backbone (r=4 on nano's 32-wide layers is a big share
    # of it; docs/memory.md has a larger preset)
    assert lora_row.total < 0.3 * full_row.total


def test_a_lora_critic_from_the_reward_model_starts_at_its_score(nano_rm):
    cfg = cast_config(**{"reward.model": str(nano_rm), "model.lora_r": 4, "model.critic_lora_r": 4})
    cast = build_cast(cfg)  # auto: a LoRA critic asks for a critic of its own
    assert cast.value_layout == "from_reward" and cast.critic is not None
    rm = next(s for s, _ in cast.reward.sources).model
    tok = cast.tokenizer
    enc = tok(["copy: red\nanswer: red"], return_tensors="pt", add_special_tokens=False)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    values = M.token_values(cast.critic, ids, mask)
    with torch.no_grad():
        score = rm.score(M.backbone_hidden(rm, ids, mask)).sum(-1)  # every head, weight 1
    torch.testing.assert_close(values, score, rtol=1e-5, atol=1e-5)


def test_a_lora_critic_run_resumes_bit_identically_and_saves_adapters_and_head(tmp_path):
    lora = ("model.critic_lora_r=4", "model.reference_precision=bf16")
    straight = PPOTrainer(make_cfg(tmp_path, f"log.output_dir={tmp_path / 'a'}", *lora))
    straight.fit()
    half = PPOTrainer(make_cfg(tmp_path, f"log.output_dir={tmp_path / 'b'}", *lora))
    half.cfg.ppo.iterations = 2  # stop after 2 (a checkpoint at step 2), as if killed
    half.fit()
    resumed = PPOTrainer(make_cfg(tmp_path, f"log.output_dir={tmp_path / 'b'}", *lora))
    resumed.fit(resume=True)
    for model in ("policy", "critic"):
        a = getattr(straight.cast, model).state_dict()
        b = getattr(resumed.cast, model).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), model
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]  # noqa: E731
    assert strip(read_jsonl(tmp_path / "a" / "metrics.jsonl")) == strip(
        read_jsonl(tmp_path / "b" / "metrics.jsonl")
    )
    # the critic's checkpoint: its adapters and value head, no backbone weight
    folder = tmp_path / "a" / "checkpoints" / "step-4" / "critic"
    saved = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert saved and all("lora_" in k or k.endswith(("score.weight", "score.bias")) for k in saved)
    trained = [p for p in straight.cast.critic.parameters() if p.requires_grad]
    assert sum(v.numel() for v in saved.values()) == sum(p.numel() for p in trained)


def test_the_report_says_a_lora_reference_is_the_policy_with_adapters_off(tmp_path):
    # it listed "reference model 0 parameters"
    from pathlib import Path

    from rlhflab.app.report_parts import run_facts
    from rlhflab.trainers.ppo_metrics import model_sizes

    t = PPOTrainer(make_cfg(tmp_path, "model.lora_r=4"))
    sizes = model_sizes(t.cast)
    assert sizes["reference"]["shares_policy"] and sizes["policy"]["trained"] > 0
    html = run_facts({"models": sizes, "wall_s": 1.0}, [], Path("run"))
    row = html.split("<td>reference model</td>")[1].split("</tr>")[0]
    assert "the policy with its LoRA adapters off" in row and "parameters" not in row
