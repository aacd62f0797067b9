"""A tokenizer that puts BOS before every text (Llama 2, Mistral, Gemma, Llama 3): prompts
get it once, as ``tokenizer(text)`` and ``generate`` give it, in sampling, SFT/DPO pairs
and the reward model's input; a chat template that writes BOS itself gets no second one.
Before, every encoder passed ``add_special_tokens=False`` and BOS was never there."""

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


def test_tokenizers_that_add_nothing_are_left_as_they_were():
    # the presets', SmolLM2's, GPT-2's and Qwen2's tokenizers put nothing before a text
    tok = M.load_tokenizer(M.resolve_path("preset:nano"))
    assert M.leading_special_ids(tok) == []
    assert (
        M.encode_prompt(tok, "copy: cat") == tok("copy: cat", add_special_tokens=False)["input_ids"]
    )
