"""One model as a command loads and finishes it, for tests of the model options (the CPU
attention's precision, the kept 16-bit weight copies), a small left-padded batch, and the
opener probe's number computed the plain way."""

import torch

from rlhflab.config import load_config
from rlhflab.models.build import finish_models, load_model, load_tokenizer_for, to_trained

REWARD = {"functions": {"rlhflab.builtin.toy_rewards:vowel_reward": 1.0}}


def loaded(policy, runtime, *overrides, trained=True, precision="fp32", eval_mode=True):
    """``policy`` loaded on ``runtime`` with the ``model.*`` ``overrides``: a trained model
    (fp32 master weights, finished as a trained model) or a frozen one in ``precision``."""
    cfg = load_config(
        base={"model": {"policy": policy, "runtime": runtime}, "reward": REWARD},
        overrides=list(overrides),
    )
    tok = load_tokenizer_for(cfg.model.policy, cfg.model)
    model = load_model(cfg.model.policy, tok, cfg.model, trained=trained, precision=precision)
    if trained:
        finish_models(cfg.model, "cpu", trained=(model,))
        model = to_trained(model, "cpu", "policy")
    else:
        finish_models(cfg.model, "cpu", frozen=(model,))
    return model.eval() if eval_mode else model


def batch():
    """(3, 10) token ids of the nano vocabulary and their mask, the first row left-padded."""
    ids = torch.randint(3, 400, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return ids, mask


def probe_by_plain_loop(lm, tok, prompts: list[list[int]], phrase: str) -> list[float]:
    """The opener probe's number for ``phrase`` done the plain way: per prompt, one whole
    forward over prompt + spelling for each spelling (with and without a leading space, its
    first 4 tokens), log-probs summed, the spellings' probabilities added (logsumexp)."""
    out = []
    for p in prompts:
        total = []
        for v in (phrase, " " + phrase):
            r = tok(v, add_special_tokens=False)["input_ids"][:4]
            with torch.no_grad():
                logp = torch.log_softmax(lm(torch.tensor([p + r])).logits[0].double(), -1)
            total.append(sum(logp[len(p) - 1 + j, x] for j, x in enumerate(r)))
        out.append(float(torch.logsumexp(torch.stack(total), 0)))
    return out
