"""A tokenizer that puts BOS before every text (Llama 2, Mistral, Gemma, Llama 3): prompts
get it once, as ``tokenizer(text)`` and ``generate`` give it, in sampling, SFT/DPO pairs
and the reward model's input; a chat template that writes BOS itself gets no second one.
Before, every encoder passed ``add_special_tokens=False`` and BOS was never there."""

import json
from pathlib import Path

import pytest
import torch
from tokenizers.processors import TemplateProcessing

from rlhflab import models as M
from rlhflab.experience import chat
from rlhflab.experience.rewards import encode_for_reward
from rlhflab.experience.rollout import generate_rollout
from rlhflab.models.presets import build_tokenizer, default_corpus
from rlhflab.trainers.sft import encode_pairs

PROMPTS = ["copy: cat dog\nanswer:", "add: 2 3\nanswer:"]


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer(default_corpus())
    bos = tok.bos_token_id
    tok._tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=bos, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # a random model that answers differently with and without BOS
    folder = tmp_path_factory.mktemp("bos") / "llama_bos"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.filterwarnings("ignore:top_k/top_p sampling")  # greedy: top_k=1
@pytest.mark.parametrize("runtime", ["transformers", "native"])
def test_greedy_answers_are_generates_with_the_tokenizers_own_bos(bos_model, runtime):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = M.load_tokenizer(bos_model, runtime=runtime)
    bos = tok.bos_token_id
    assert M.leading_special_ids(tok) == [bos]
    lm = M.load_causal_lm(bos_model, tok, runtime=runtime).eval()
    ro = generate_rollout(lm, tok, PROMPTS, 6, 1.0, 1, 1.0, None, "cpu", ignore_eos=True)
    hf_tok = AutoTokenizer.from_pretrained(bos_model)
    hf = AutoModelForCausalLM.from_pretrained(bos_model).eval()
    for i, p in enumerate(PROMPTS):
        enc = hf_tok(p, return_tensors="pt")  # the default: with BOS
        assert enc["input_ids"][0, 0] == bos
        want = hf.generate(**enc, do_sample=False, max_new_tokens=6, pad_token_id=tok.pad_token_id)
        assert ro.response_ids[i].tolist() == want[0, enc["input_ids"].shape[1] :].tolist()
        real = ro.prompt_ids[i][ro.prompt_mask[i].bool()]
        assert real.tolist() == enc["input_ids"][0].tolist()


def test_bos_is_put_once_before_prompts_pairs_and_reward_inputs(bos_model):
    tok = M.load_tokenizer(bos_model)
    bos = tok.bos_token_id
    assert M.encode_prompt(tok, "copy: cat")[0] == bos
    assert M.encode_prompt(tok, "<s>copy: cat").count(bos) == 1  # written already: once
    ids, attn, loss_mask = encode_pairs(tok, [("copy: cat\nanswer:", " cat")])
    assert ids[0, 0] == bos and int((ids[0] == bos).sum()) == 1 and loss_mask[0, 0] == 0
    ids, mask = encode_for_reward(tok, ["copy: cat\nanswer:"], [" cat"], [True])
    first = int(mask[0].nonzero()[0])
    assert ids[0, first] == bos and int((ids[0] == bos).sum()) == 1
    # a chat template that writes the BOS itself: not a second one
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    text = chat.render_prompt([{"role": "user", "content": "copy: cat"}], tok, "row 1", "prompt")
    assert M.encode_prompt(tok, text).count(bos) == 1


def test_a_reward_tokenizer_that_adds_bos_where_the_policys_does_not_is_another(bos_model):
    # same vocabulary, EOS and pad: the policy's ids (no BOS) went to the reward model as
    # they were, where its own encoding (training) starts with BOS
    plain = M.load_tokenizer(M.resolve_path("preset:nano"))
    with_bos = M.load_tokenizer(bos_model)
    assert plain.get_vocab() == with_bos.get_vocab()
    assert not M.same_tokenizer(plain, with_bos) and M.same_tokenizer(with_bos, with_bos)


def test_tokenizers_that_add_nothing_are_left_as_they_were():
    # the presets', SmolLM2's, GPT-2's and Qwen2's tokenizers put nothing before a text
    tok = M.load_tokenizer(M.resolve_path("preset:nano"))
    assert M.leading_special_ids(tok) == []
    assert (
        M.encode_prompt(tok, "copy: cat") == tok("copy: cat", add_special_tokens=False)["input_ids"]
    )


def test_answers_end_at_every_id_the_generation_config_lists(tmp_path, caplog):
    # a Gemma-2-it-like checkpoint: its turn ends with <end_of_turn>, which is not the
    # tokenizer's EOS but is in generation_config.json's eos_token_id; this model always
    # writes it. Stopping at EOS alone ran every answer to max_new_tokens
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = build_tokenizer(default_corpus())
    tok.add_special_tokens({"additional_special_tokens": ["<end_of_turn>"]})
    eot = tok.convert_tokens_to_ids("<end_of_turn>")
    cfg = GPT2Config(
        vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=2,
        eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    with torch.no_grad():  # every position's logits: <end_of_turn> far ahead
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.zero_()
        model.transformer.ln_f.bias[0] = 1.0
        model.transformer.wte.weight[eot, 0] = 50.0
    for name, listed in (("eot", [tok.eos_token_id, eot]), ("plain", tok.eos_token_id)):
        model.generation_config.eos_token_id = listed
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    with caplog.at_level("INFO", logger="rlhflab.models.text"):
        loaded = M.load_tokenizer(tmp_path / "eot")
    # an id the tokenizer does not have is left out, and said
    gen = json.loads((tmp_path / "eot" / "generation_config.json").read_text())
    (tmp_path / "odd").mkdir()
    tok.save_pretrained(tmp_path / "odd")
    (tmp_path / "odd" / "generation_config.json").write_text(
        json.dumps({**gen, "eos_token_id": [tok.eos_token_id, 10**6]})
    )
    with caplog.at_level("WARNING", logger="rlhflab.models.text"):
        assert M.stop_ids(M.load_tokenizer(tmp_path / "odd")) == (tok.eos_token_id,)
    assert "[1000000] are no token ids of the tokenizer" in caplog.text
    assert M.stop_ids(loaded) == (tok.eos_token_id, eot)
    assert any("'<end_of_turn>'" in r.message for r in caplog.records)
    lm = M.load_causal_lm(tmp_path / "eot", loaded).eval()
    ro = generate_rollout(lm, loaded, PROMPTS, 6, 1.0, 0, 1.0, None, "cpu")
    assert ro.response_mask.sum(1).tolist() == [1, 1] and ro.ended.all()
    assert (ro.response_ids[:, 0] == eot).all() and ro.responses == ["", ""]
    # a folder that lists only EOS (and an ignore_eos run) goes on to max_new_tokens
    plain = M.load_tokenizer(tmp_path / "plain")
    assert M.stop_ids(plain) == (tok.eos_token_id,)
    ro = generate_rollout(lm, plain, PROMPTS, 6, 1.0, 0, 1.0, None, "cpu")
    assert ro.response_mask.sum(1).tolist() == [6, 6] and not ro.ended.any()


def test_a_native_model_saves_the_generation_config_it_was_read_with(tmp_path):
    # the native runtime wrote config.json and weights only: an SFT output or export of a
    # chat checkpoint lost the stop ids of its generation_config.json
    src = M.resolve_path("preset:nano")
    tok = M.load_tokenizer(src, runtime="native")
    lm = M.load_causal_lm(src, tok, runtime="native")
    fields = json.loads((Path(src) / "generation_config.json").read_text())
    fields["eos_token_id"] = [tok.eos_token_id, 5]
    lm.generation_fields = fields
    lm.save_pretrained(tmp_path / "out")
    tok.save_pretrained(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == fields
    assert M.stop_ids(M.load_tokenizer(tmp_path / "out")) == (tok.eos_token_id, 5)
    again = M.load_causal_lm(tmp_path / "out", tok, runtime="native")
    assert again.generation_fields == fields


def test_a_lora_folder_ends_answers_where_its_base_model_does(tmp_path):
    # a PEFT folder holds no generation_config.json: its base's stop ids were lost, so
    # generate/eval on a LoRA run's checkpoint ran on past the turn's end
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = build_tokenizer(default_corpus())
    tok.add_special_tokens({"additional_special_tokens": ["<end_of_turn>"]})
    eot = tok.convert_tokens_to_ids("<end_of_turn>")
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=1, n_head=2)
    )
    model.generation_config.eos_token_id = [tok.eos_token_id, eot]
    model.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    lora = M.apply_lora(M.load_causal_lm(tmp_path / "base", tok), 4, 8, "all-linear")
    lora.save_pretrained(tmp_path / "adapter")
    tok.save_pretrained(tmp_path / "adapter")
    assert not (tmp_path / "adapter" / "generation_config.json").exists()
    assert M.stop_ids(M.load_tokenizer(tmp_path / "adapter")) == (tok.eos_token_id, eot)
