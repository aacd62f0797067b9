"""Data from `datasets` (Dataset, DatasetDict, save_to_disk folders) and lists of dicts, and
chat rows (TRL's conversational format) for every stage's loader (issue #31, item 2)."""

import json
import re
import subprocess
import sys

import pytest

datasets = pytest.importorskip("datasets")

from rlhflab.app.cli import main  # noqa: E402
from rlhflab.experience.data import (  # noqa: E402
    DataError,
    PreferencePair,
    load_preferences,
    load_prompts,
)
from rlhflab.infra.runlog import read_jsonl  # noqa: E402
from rlhflab.models import load_tokenizer  # noqa: E402
from rlhflab.models.presets import preset_path  # noqa: E402
from rlhflab.trainers.sft import load_sft_pairs  # noqa: E402

# end-of-turn markup, so that a test sees whether an answer keeps the template's markup
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
USER = [{"role": "user", "content": "copy: cat"}]
HEAD = "<|user|>copy: cat<|end|><|assistant|>"  # USER as the policy sees it when it answers


def said(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


@pytest.fixture
def tok():
    t = load_tokenizer(preset_path("nano"))
    t.chat_template = TEMPLATE
    return t


def source(kind: str, rows: list[dict], folder, split: str = "train"):
    """``rows`` as a source of ``kind`` (a folder ``kind`` writes to ``folder``); a
    DatasetDict holds them in ``split`` beside an 'other' split of different rows, so that
    reading the wrong split cannot pass."""
    if kind == "list":
        return rows
    ds = datasets.Dataset.from_list(rows)
    decoy = datasets.Dataset.from_list(rows[:1] * 3)
    obj = datasets.DatasetDict({split: ds, "other": decoy}) if "Dict" in kind else ds
    if "folder" not in kind:
        return obj
    obj.save_to_disk(str(folder))
    return str(folder)


KINDS = ["list", "Dataset", "DatasetDict", "folder", "DatasetDict-folder"]
PROMPTS = [{"prompt": "copy: cat\nanswer:"}, {"prompt": "copy: dog\nanswer:"}]
SFT = [{"prompt": "copy: cat\nanswer:", "response": " cat"}, {"prompt": "a", "response": " b"}]
PAIRS = [
    # Dataset.from_list takes its columns from the first row: both rows hold labels
    {
        "prompt": "copy: cat\nanswer:",
        "chosen": " cat",
        "rejected": " dog",
        "labels": {"brevity": 0.0},
    },
    {"prompt": "x", "chosen": " y", "rejected": " z", "labels": {"brevity": 1.0}},
]


@pytest.mark.parametrize("kind", KINDS)
def test_every_source_reads_as_the_same_rows_in_a_jsonl_file(tmp_path, tok, kind):
    def jsonl(rows, name):
        f = tmp_path / f"{name}.jsonl"
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return f

    got = load_prompts(source(kind, PROMPTS, tmp_path / "p", "test"), tok, 64, split="test")[0]
    assert got == load_prompts(jsonl(PROMPTS, "p"), tok, 64)[0] == [r["prompt"] for r in PROMPTS]
    sft = load_sft_pairs(source(kind, SFT, tmp_path / "s", "test"), tok, "test")
    assert sft == load_sft_pairs(jsonl(SFT, "s")) == [(r["prompt"], r["response"]) for r in SFT]
    pairs = load_preferences(source(kind, PAIRS, tmp_path / "r", "test"), tok, "test")
    assert pairs == load_preferences(jsonl(PAIRS, "r"))
    assert pairs[1] == PreferencePair("x", " y", " z", {"brevity": 1.0})


def test_a_datasetdict_without_the_split_names_the_ones_it_has(tmp_path, tok):
    dd = datasets.DatasetDict(
        {"test": datasets.Dataset.from_list(PAIRS), "dev": datasets.Dataset.from_list(PAIRS)}
    )
    with pytest.raises(
        DataError, match=r"^DatasetDict: no split 'train' \(data\.split\); it has 'dev', 'test'$"
    ):
        load_preferences(dd, tok)
    dd.save_to_disk(str(tmp_path / "pairs"))
    with pytest.raises(DataError, match=r"pairs: no split 'train' \(data\.split\); it has 'dev'"):
        load_sft_pairs(str(tmp_path / "pairs"), tok)
    assert len(load_preferences(str(tmp_path / "pairs"), tok, split="dev")) == 2


def test_folders_that_cannot_be_read_say_why(tmp_path, tok, monkeypatch):
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(DataError, match=r"plain: a folder, but not one written by save_to_disk"):
        load_prompts(plain, tok, 64)
    folder = tmp_path / "ds"
    datasets.Dataset.from_list(PROMPTS).save_to_disk(str(folder))
    for shard in folder.glob("*.arrow"):
        shard.unlink()
    with pytest.raises(DataError, match=r"ds: not a readable dataset folder"):
        load_prompts(folder, tok, 64)
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if it were not installed
    with pytest.raises(
        DataError,
        match=r"ds: reading a dataset folder needs datasets \(pip install 'rlhflab\[data\]'\)",
    ):
        load_prompts(folder, tok, 64)


def test_importing_rlhflab_does_not_import_datasets():
    code = (
        "import sys, rlhflab.app.cli, rlhflab.trainers.sft, rlhflab.trainers.rm, "
        "rlhflab.trainers.dpo, rlhflab.trainers.ppo, rlhflab.experience.data; "
        "print('datasets' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_chat_prompts_render_with_the_generation_prompt(tok):
    rows = [{"prompt": USER}, {"messages": USER}, {"prompt": "plain text"}]
    assert load_prompts(rows, tok, 64)[0] == [HEAD, HEAD, "plain text"]


def test_sft_chat_rows_cut_the_whole_conversation_after_the_generation_prompt(tok):
    talk = [*USER, *said("cat"), {"role": "user", "content": "again"}, *said("cat cat")]
    rows = [
        {"messages": talk},
        {"prompt": USER, "completion": said("cat")},
        {"prompt": USER, "completion": "cat"},
        {"prompt": USER, "response": "cat"},
    ]
    (p0, r0), *rest = load_sft_pairs(rows, tok)
    assert p0 + r0 == tok.apply_chat_template(talk, tokenize=False)
    assert p0 == tok.apply_chat_template(talk[:3], tokenize=False, add_generation_prompt=True)
    assert r0 == "cat cat<|end|>"  # the content and the template's end of turn
    assert rest == [(HEAD, "cat<|end|>")] * 3


def test_a_template_that_ends_the_turn_with_eos_gives_one_eos_as_a_rollout_does(tok):
    """ChatML (SmolLM2, Qwen) closes a turn with the EOS token and a newline: the answer
    keeps neither, and encoded as SFT and the reward model encode it, it ends with exactly
    one EOS, where a PPO rollout of the same answer ends."""
    from rlhflab.trainers.sft import encode_pairs

    tok.chat_template = TEMPLATE.replace("<|end|>", "{{ eos_token }}\n")
    (prompt, answer), *_ = load_sft_pairs([{"prompt": USER, "completion": "cat"}], tok)
    assert answer == "cat"
    ids, attn, loss_mask = encode_pairs(tok, [(prompt, answer)])
    row = ids[0][attn[0].bool()].tolist()
    assert (
        row[-1] == tok.eos_token_id
        and row.count(tok.eos_token_id) == prompt.count(tok.eos_token) + 1
    )


def test_a_generation_prompt_the_whole_conversation_does_not_start_with(tok):
    # like DeepSeek-R1's: <think> after the generation prompt only; the cut falls where the
    # two agree, so that prompt + response is still the whole conversation
    tok.chat_template = TEMPLATE.replace(
        "<|assistant|>{% endif %}", "<|assistant|><think>{% endif %}"
    )
    ((prompt, response),) = load_sft_pairs([{"messages": [*USER, *said("cat")]}], tok)
    assert (prompt, response) == (HEAD, "cat<|end|>")


def test_preference_chat_rows_explicit_and_implicit_prompt(tok):
    rows = [
        {"prompt": USER, "chosen": said("cat"), "rejected": said("dog")},
        {"prompt": USER, "chosen": "cat", "rejected": "dog"},
        {"chosen": [*USER, *said("cat")], "rejected": [*USER, *said("dog")]},
    ]
    pairs = load_preferences(datasets.Dataset.from_list(rows[2:]), tok) + load_preferences(
        rows, tok
    )
    assert pairs == [PreferencePair(HEAD, "cat<|end|>", "dog<|end|>", {})] * 4


def test_struct_labels_unset_in_a_row_are_not_labels(tok):
    # a datasets struct column gives every row every key; None there means "no label"
    rows = [dict(PAIRS[0], labels={"brevity": 1.0}), dict(PAIRS[0], labels={"politeness": 0.0})]
    pairs = load_preferences(datasets.Dataset.from_list(rows), tok)
    assert [p.labels for p in pairs] == [{"brevity": 1.0}, {"politeness": 0.0}]


GOOD = {"prompt": USER, "chosen": said("cat"), "rejected": said("dog")}


@pytest.mark.parametrize(
    "loader,bad,message",
    [
        (
            "sft",
            {"messages": [*said("cat"), *USER]},
            "field 'messages': the last message must be the assistant's answer (message 2 is 'user')",
        ),
        (
            "sft",
            {"messages": said("cat")},
            "field 'messages' has no message before the assistant's answer",
        ),
        ("sft", {"prompt": USER}, "missing field 'completion' (or 'response')"),
        (
            "sft",
            {"prompt": "x", "completion": said("cat")},
            "field 'completion' is a message list but field 'prompt' is a string",
        ),
        (
            "sft",
            {"prompt": USER, "completion": "c", "response": "r"},
            "fields 'completion' and 'response' are both set",
        ),
        (
            "pairs",
            dict(GOOD, prompt=[{"role": "user"}]),
            "field 'prompt': message 1 is not a {role, content} pair of strings",
        ),
        (
            "pairs",
            dict(GOOD, prompt=[]),
            "field 'prompt' must be a non-empty list of {role, content} messages",
        ),
        ("pairs", dict(GOOD, chosen=said(" ")), "field 'chosen': the assistant's answer is empty"),
        (
            "pairs",
            {
                "chosen": [*USER, *said("a")],
                "rejected": [{"role": "user", "content": "x"}, *said("b")],
            },
            "fields 'chosen' and 'rejected' differ at message 1",
        ),
        ("pairs", {"chosen": [*USER, *said("a")]}, "missing field 'rejected'"),
        (
            "pairs",
            dict(GOOD, prompt="x"),
            "field 'chosen' is a message list but field 'prompt' is a string",
        ),
        (
            "prompts",
            {"prompt": [*USER, 3]},
            "field 'prompt': message 2 is not a {role, content} pair of strings",
        ),
        ("prompts", {"prompt": 7}, "field 'prompt' must be a string or a non-empty list"),
    ],
)
def test_bad_chat_rows_name_the_row_and_the_field(tmp_path, tok, loader, bad, message):
    good = {"sft": {"prompt": "a", "response": "b"}, "pairs": GOOD, "prompts": {"prompt": "a"}}
    rows = [good[loader], bad]
    read = {
        "sft": lambda src: load_sft_pairs(src, tok),
        "pairs": lambda src: load_preferences(src, tok),
        "prompts": lambda src: load_prompts(src, tok, 64),
    }[loader]
    with pytest.raises(DataError, match="^" + re.escape(f"list row 2: {message}")):
        read(rows)
    f = tmp_path / "d.jsonl"  # a file's rows keep their FILE:LINE names
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=re.escape(f"d.jsonl:2: {message}")):
        read(f)


def test_chat_rows_without_a_chat_template_name_the_row_and_field(tmp_path, tok):
    tok.chat_template = None
    folder = tmp_path / "pairs"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([GOOD])}).save_to_disk(str(folder))
    need = "holds chat messages, which need a tokenizer with a chat template"
    with pytest.raises(DataError, match=rf"pairs\[train\] row 1: field 'prompt' {need}"):
        load_preferences(str(folder), tok)
    implicit = {"chosen": [*USER, *said("cat")], "rejected": [*USER, *said("dog")]}
    with pytest.raises(DataError, match=rf"^Dataset row 1: field 'chosen' {need}"):
        load_preferences(datasets.Dataset.from_list([implicit]))  # no tokenizer at all
    with pytest.raises(DataError, match=rf"^list row 1: field 'messages' {need}"):
        load_sft_pairs([{"messages": [*USER, *said("cat")]}], tok)
    prompts, report = load_prompts([{"prompt": "a"}, {"prompt": USER}], tok, 64, on_bad_row="skip")
    assert prompts == ["a"] and report.reasons == [f"list row 2: field 'prompt' {need}"]


def test_sft_and_dpo_commands_train_on_save_to_disk_folders_of_chat_rows(
    tmp_path, capsys, monkeypatch
):
    from rlhflab.trainers import dpo, sft

    seen, encode = [], sft.encode_pairs  # every (prompt, answer) the trainers encode

    def spy(tokenizer, pairs):
        seen.extend(pairs)
        return encode(tokenizer, pairs)

    monkeypatch.setattr(dpo, "encode_pairs", spy)
    monkeypatch.setattr(sft, "encode_pairs", spy)
    head = "user: copy: cat\nassistant:"  # the nano preset's own chat template
    folder = tmp_path / "sft-data"
    datasets.Dataset.from_list([{"messages": [*USER, *said("cat")]}] * 6).save_to_disk(str(folder))
    out = tmp_path / "sft"
    args = ["sft", "model.policy=preset:nano", f"sft.data={folder}", f"sft.output_dir={out}"]
    assert main([*args, "sft.steps=2", "sft.batch_size=2", "log.progress=false"]) == 0
    assert [r["iteration"] for r in read_jsonl(out / "run" / "metrics.jsonl")] == [1, 2]
    assert seen and set(seen) == {(head, " cat\n")}

    seen.clear()
    folder = tmp_path / "pairs"
    rows = [{"chosen": [*USER, *said("cat")], "rejected": [*USER, *said("dog")]}] * 4
    decoy = [{"prompt": "x", "chosen": "y", "rejected": "z"}]  # the split not asked for
    datasets.DatasetDict(
        {"test": datasets.Dataset.from_list(rows), "train": datasets.Dataset.from_list(decoy)}
    ).save_to_disk(str(folder))
    args = ["dpo", "model.policy=preset:nano", f"dpo.data={folder}", "data.split=test"]
    args += ["dpo.steps=2", "dpo.batch_size=2", f"log.output_dir={tmp_path / 'dpo'}"]
    assert main([*args, "log.progress=false"]) == 0, capsys.readouterr().err
    assert len(read_jsonl(tmp_path / "dpo" / "metrics.jsonl")) == 2
    assert set(seen) == {(head, " cat\n"), (head, " dog\n")}


def test_a_lone_surrogate_or_a_row_nested_too_deeply_is_a_bad_row(tmp_path):
    """JSON can escape half of a surrogate pair ("\\ud800"), which no encoding writes: the
    tokenizer raised a TypeError traceback from inside every command; a row nested 100,000
    deep raised RecursionError. Both are bad rows naming the line (and the field)."""
    from rlhflab.experience.data import DataError, load_prompts
    from rlhflab.models import load_tokenizer
    from rlhflab.models.presets import preset_path

    tok = load_tokenizer(preset_path("nano"))
    f = tmp_path / "p.jsonl"
    rows = ['{"prompt": "a \\ud83d\\ude00"}', '{"prompt": "copy: \\ud800 cat"}']
    rows += ['{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", '{"prompt": "c"}']
    f.write_text("\n".join(rows) + "\n")
    with pytest.raises(DataError, match=r"p\.jsonl:2: field 'prompt' is not valid Unicode"):
        load_prompts(f, tok, 64)
    prompts, report = load_prompts(f, tok, 64, on_bad_row="skip")
    assert prompts == ["a \U0001f600", "c"] and report.skipped == 2  # a paired one is fine


def test_prompt_rows_with_both_prompt_and_messages_read_the_prompt_and_say_so(tmp_path, caplog):
    # the messages were ignored without a word; many Hub prompt sets hold both columns, so
    # the prompt field is read, as before, and the log says it
    from rlhflab.experience.data import load_prompts
    from rlhflab.models import load_tokenizer
    from rlhflab.models.presets import preset_path

    f = tmp_path / "p.jsonl"
    both = {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}
    f.write_text(json.dumps({"prompt": "c"}) + "\n" + json.dumps(both) + "\n")
    with caplog.at_level("WARNING", logger="rlhflab.experience.data"):
        prompts, _ = load_prompts(f, load_tokenizer(preset_path("nano")), 64)
    assert prompts == ["c", "a"]
    assert "1 row holds both 'prompt' and 'messages'; 'prompt' is read" in caplog.text


def test_a_csv_cell_longer_than_the_csv_modules_default_limit_is_read(tmp_path):
    # a 200,000-character prompt is valid CSV; it was refused as "not valid CSV" (csv's
    # 131,072-character field limit), with the line before it named
    from rlhflab.trainers.sft import load_sft_pairs

    f = tmp_path / "s.csv"
    f.write_text("prompt,response\nshort,a\n" + "x" * 200_000 + ",b\n")
    pairs = load_sft_pairs(f)
    assert [len(p) for p, _ in pairs] == [5, 200_000]
