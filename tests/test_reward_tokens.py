"""The reward model sees at PPO time the tokens it was trained and checked on (issue #24)."""

import pytest
import torch

from rlhflab import models as M
from rlhflab.config import load_config
from rlhflab.experience import rewards as R
from rlhflab.experience.cast import build_cast
from rlhflab.experience.data import PreferencePair
from rlhflab.experience.rollout import Rollout, left_pad, score_rollout
from rlhflab.models.presets import preset_path
from rlhflab.trainers.rm import heldout_scores

# "answer: " + "red": joint tokenization merges the space into " red"; a rollout encodes the
# prompt alone (its trailing space is a token of its own) and the policy samples "red" after
PAIRS = [
    PreferencePair("copy: red\nanswer: ", "red", "blue"),
    PreferencePair("add: 2 2\nanswer:", " 4", " 5 is the answer"),
    PreferencePair("sort: dog cat\nanswer:", " cat dog", " dog"),
]


def as_rollout(tok, prompts, answers, ended):
    """What sampling leaves behind had it drawn each answer's own tokens: prompts encoded
    alone and left-padded, answers right-padded, EOS only after the ones that ended."""
    prompt_ids, prompt_mask = left_pad(
        [tok(p, add_special_tokens=False)["input_ids"] for p in prompts], tok.pad_token_id
    )
    rows = [
        tok(a, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if e else [])
        for a, e in zip(answers, ended)
    ]
    width = max(len(r) for r in rows)
    resp = torch.full((len(rows), width), tok.pad_token_id)
    resp_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        resp[i, : len(r)], resp_mask[i, : len(r)] = torch.tensor(r), 1
    return Rollout(prompt_ids, prompt_mask, resp, resp_mask, torch.tensor(ended), prompts, answers)


def test_a_pair_scores_the_same_in_rm_evaluation_and_in_ppo_scoring(nano_rm):
    cfg = load_config(
        base={"device": "cpu"},
        overrides=["model.policy=preset:nano", f"reward.model={nano_rm}"],
    )
    cast = build_cast(cfg)
    rm = next(s for s, _ in cast.reward.sources if isinstance(s, R.ModelReward))
    assert not rm.reencode  # the policy's token ids go to the reward model as they are
    prompts = [p.prompt for p in PAIRS] * 2
    answers = [p.chosen for p in PAIRS] + [p.rejected for p in PAIRS]
    rollout = as_rollout(cast.tokenizer, prompts, answers, [True] * len(answers))
    score_rollout(cast, rollout, temperature=1.0, micro_batch=len(answers))
    in_ppo = torch.stack([rollout.components[f"rm/{h}"] for h in rm.head_names], 1)
    chosen, rejected = heldout_scores(rm.model, cast.tokenizer, PAIRS, "cpu")
    assert torch.equal(in_ppo, torch.cat([chosen, rejected]))


def test_re_encoding_appends_eos_only_to_answers_that_ended(foreign_rm):
    policy_tok = M.load_tokenizer(preset_path("nano"))
    rm_tok = M.load_tokenizer(foreign_rm)
    rm = M.freeze(M.load_sequence_classifier(foreign_rm, rm_tok))
    source = R.ModelReward(rm, rm_tok, policy_tok)
    assert source.reencode
    prompts, answers, ended = ["sort: dog cat\nanswer:"] * 2, [" cat dog", " cat do"], [1, 0]
    ro = as_rollout(policy_tok, prompts, answers, [bool(e) for e in ended])
    got = source(R.RewardBatch(prompts, answers, ro.sequences, ro.attention_mask, ro.ended))
    for i, (p, a) in enumerate(zip(prompts, answers)):
        ids = rm_tok(p, add_special_tokens=False)["input_ids"]
        ids += rm_tok(a, add_special_tokens=False)["input_ids"] + [rm_tok.eos_token_id] * ended[i]
        with torch.no_grad():
            direct = rm(input_ids=torch.tensor([ids])).logits[0, 0]
        assert got["rm/score"][i].item() == pytest.approx(direct.item(), abs=1e-5), i
    ids, mask = R.encode_for_reward(rm_tok, prompts, answers, ended)
    last = ids[torch.arange(2), M.last_real_index(mask)]
    assert last.tolist()[0] == rm_tok.eos_token_id and last.tolist()[1] != rm_tok.eos_token_id


def test_scoring_text_without_knowing_which_answers_ended_is_refused(foreign_rm):
    policy_tok = M.load_tokenizer(preset_path("nano"))
    rm_tok = M.load_tokenizer(foreign_rm)
    rm = M.freeze(M.load_sequence_classifier(foreign_rm, rm_tok))
    with pytest.raises(R.RewardError, match="ended"):
        R.ModelReward(rm, rm_tok, policy_tok)(R.RewardBatch(["p"], [" a"]))


def test_an_answer_that_ended_at_another_stop_id_is_read_at_eos(nano_rm, tmp_path):
    """A chat model's turn ends at a stop id of its own (generation_config.json's list):
    the same-tokenizer path read the reward there, where training and the re-encoding
    path (encode_for_reward) put EOS; now both read at EOS."""
    import json
    import shutil

    from rlhflab.models.text import record_stop_ids

    policy_tok = M.load_tokenizer(preset_path("nano"))
    folder = tmp_path / "policy"
    shutil.copytree(preset_path("nano"), folder)
    other = 7  # some token id the policy ends its turn with
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [policy_tok.eos_token_id, other]})
    )
    record_stop_ids(policy_tok, folder)
    rm_tok = M.load_tokenizer(nano_rm)
    rm = M.freeze(M.load_sequence_classifier(nano_rm, rm_tok))
    source = R.ModelReward(rm, rm_tok, policy_tok)
    assert not source.reencode
    prompts, answers = ["sort: dog cat\nanswer:"] * 2, [" cat dog", " cat dog"]
    ro = as_rollout(policy_tok, prompts, answers, [True, True])
    seqs = ro.sequences.clone()
    last = M.last_real_index(ro.attention_mask)
    seqs[1, last[1]] = other  # the second answer ended at the other stop id
    got = source(R.RewardBatch(prompts, answers, seqs, ro.attention_mask, ro.ended))
    assert torch.equal(got["rm/correctness"][0], got["rm/correctness"][1])
    assert seqs[1, last[1]] == other  # the rollout's own ids are left as they were


def test_a_classifiers_classes_summed_as_the_reward_are_said():
    # a sentiment classifier as reward.model: its NEGATIVE and POSITIVE logits were summed
    # (every head weighted 1) without a word
    from rlhflab.experience.cast import summed_classes_warning

    said = summed_classes_warning(["NEGATIVE", "POSITIVE"], {})
    assert "summed with weight 1 each" in said and "reward.heads={POSITIVE: 1.0}" in said
    assert summed_classes_warning(["LABEL_0", "LABEL_1"], {}) is not None
    assert summed_classes_warning(["NEGATIVE", "POSITIVE"], {"POSITIVE": 1.0}) is None
    assert summed_classes_warning(["LABEL_0"], {}) is None  # one head: it is the reward
    assert summed_classes_warning(["preference", "brevity"], {}) is None  # rlhflab's heads
