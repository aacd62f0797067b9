"""`rlhflab convert-gguf`: a GGUF file built here from a preset (no download) comes back as a
plain Hugging Face folder that transformers and the native runtime load with the original's
logits and token ids; every refusal is exit 2 and one line naming the file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from rlhflab.app.cli import main
from rlhflab.models import load_causal_lm, load_tokenizer
from rlhflab.models.presets import build_preset
from tests.gguf_helpers import write_gguf

TEXTS = [
    "What is 2+3?",
    "  two  spaces\n\nand a new line",
    "héllo ✓ 日本語 — bytes the corpus never saw",
]
MESSAGES = [{"role": "user", "content": "What is 2+3?"}]


def _grouped_query_source(folder):
    """The nano preset reshaped to 4 query heads sharing 2 key/value heads, so the test
    covers the key rows regrouped with another head count than the query rows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_pretrained(folder)
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 4, 2, 8
    torch.manual_seed(1)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("gguf")
    root = tmp_path_factory.mktemp("gguf")
    source = _grouped_query_source(build_preset("nano", root / "source"))
    path = write_gguf(source, root / "nano.gguf")
    out = root / "converted"
    assert main(["convert-gguf", str(path), str(out)]) == 0
    return source, path, out


def _run(capsys, *args):
    """Exit status and the error lines of ``rlhflab convert-gguf ARGS``."""
    code = main(["convert-gguf", *map(str, args)])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, [line for line in err.splitlines() if line.startswith("error:")]


def _logits(model, tokenizer):
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**batch).logits
    return out[batch["attention_mask"].bool()]  # padded rows' values mean nothing


def test_folder_is_plain_fp32(built):
    _, _, out = built
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "float32"
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(".converted")]


def test_transformers_and_native_match_original_logits(built):
    from transformers import AutoModelForCausalLM

    source, _, out = built
    tokenizer = load_tokenizer(source)
    want = _logits(AutoModelForCausalLM.from_pretrained(source).eval(), tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # still tied
    torch.testing.assert_close(_logits(hf, tokenizer), want, atol=1e-5, rtol=1e-5)
    native = load_causal_lm(out, load_tokenizer(out, runtime="native"), runtime="native")
    assert type(native).__name__ == "NativeLlamaForCausalLM"
    torch.testing.assert_close(_logits(native.eval(), tokenizer), want, atol=1e-4, rtol=1e-4)


def test_tokenizer_encodes_the_same_ids(built):
    source, _, out = built
    original = load_tokenizer(source)
    for runtime in ("transformers", "native"):
        converted = load_tokenizer(out, runtime=runtime)
        # pad stays distinct from EOS, so rlhflab adds no pad token and no embedding row
        assert len(converted) == len(original)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            assert getattr(converted, name) == getattr(original, name), name
        assert converted(TEXTS)["input_ids"] == original(TEXTS)["input_ids"]
        chat = {"add_generation_prompt": True, "tokenize": True}
        assert converted.apply_chat_template(MESSAGES, **chat) == original.apply_chat_template(
            MESSAGES, **chat
        )
        assert converted.decode(converted(TEXTS[2])["input_ids"]) == TEXTS[2]


def test_bf16_from_half_precision_tensors(built, tmp_path):
    from safetensors import safe_open

    source, _, _ = built
    path = write_gguf(source, tmp_path / "half.gguf", half=True)
    out = tmp_path / "bf16"
    assert main(["convert-gguf", str(path), str(out), "--dtype", "bf16"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    tokenizer = load_tokenizer(source)
    want = _logits(load_causal_lm(source, tokenizer), tokenizer)
    got = _logits(load_causal_lm(out, tokenizer, runtime="native"), tokenizer)
    assert (got - want).abs().max() < 0.02 * want.abs().max()


def test_refuses_a_folder_that_is_not_empty_unless_forced(built, tmp_path, capsys):
    _, path, _ = built
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, errors = _run(capsys, path, out)
    assert code == 2 and len(errors) == 1 and str(out) in errors[0] and "--force" in errors[0]
    assert (out / "notes.txt").read_text() == "mine"
    assert _run(capsys, path, out, "--force")[0] == 0
    assert (out / "config.json").exists() and not (out / "notes.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # nothing left aside
    # --force onto the folder that holds the GGUF file itself deleted it: refused
    (out / "in.gguf").write_bytes(path.read_bytes())
    code, errors = _run(capsys, out / "in.gguf", out, "--force")
    assert code == 2 and "would delete" in errors[0]
    assert (out / "in.gguf").read_bytes() == path.read_bytes()


def test_missing_file(tmp_path, capsys):
    code, errors = _run(capsys, tmp_path / "absent.gguf", tmp_path / "out")
    assert code == 2 and len(errors) == 1
    assert str(tmp_path / "absent.gguf") in errors[0] and "no such file" in errors[0]


def test_not_a_gguf_file(tmp_path, capsys):
    bad = tmp_path / "model.gguf"
    bad.write_text("<html>a download page, not a model</html>")
    code, errors = _run(capsys, bad, tmp_path / "out")
    assert code == 2 and len(errors) == 1
    assert str(bad) in errors[0] and "not a GGUF file" in errors[0]
    assert not (tmp_path / "out").exists()


def test_truncated_file(built, tmp_path, capsys):
    _, path, _ = built
    data = path.read_bytes()
    for keep in (len(data) // 2, 64):  # cut in the tensors, and in the metadata
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(data[:keep])
        code, errors = _run(capsys, cut, tmp_path / "out")
        assert code == 2 and len(errors) == 1 and str(cut) in errors[0], errors
        assert "truncated" in errors[0]
    assert not (tmp_path / "out").exists()


def test_architecture_transformers_cannot_read(built, tmp_path, capsys):
    source, _, _ = built
    odd = write_gguf(source, tmp_path / "odd.gguf", arch="notallama")
    out = tmp_path / "out"
    code, errors = _run(capsys, odd, out)
    assert code == 2 and len(errors) == 1
    assert str(odd) in errors[0] and "'notallama'" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.gguf"]  # nothing half-written


def test_gguf_package_missing(tmp_path, capsys, monkeypatch):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ImportError
    code, errors = _run(capsys, fake, tmp_path / "out")
    assert code == 2 and len(errors) == 1
    assert str(fake) in errors[0] and "pip install 'rlhflab[gguf]'" in errors[0]


def test_importing_rlhflab_does_not_import_gguf():
    code = (
        "import sys, rlhflab, rlhflab.models, rlhflab.models.gguf, rlhflab.app.cli\n"
        "assert 'gguf' not in sys.modules, 'gguf imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_weights_that_de_quantise_to_nan_are_refused(built, tmp_path, capsys):
    # a damaged block de-quantises to NaN: written, it met the user as NaN logits later
    from safetensors.torch import load_file, save_file

    source, _, _ = built
    damaged = shutil.copytree(source, tmp_path / "damaged")
    state = load_file(damaged / "model.safetensors")
    state["model.layers.0.mlp.up_proj.weight"][1, :4] = float("nan")
    save_file(state, damaged / "model.safetensors", metadata={"format": "pt"})
    path = write_gguf(damaged, tmp_path / "nan.gguf")
    code, errors = _run(capsys, path, tmp_path / "out")
    assert code == 2 and len(errors) == 1 and str(path) in errors[0], errors
    assert "model.layers.0.mlp.up_proj.weight de-quantises to 4 NaN" in errors[0], errors[0]
    assert not (tmp_path / "out").exists()
