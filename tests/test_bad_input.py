"""Bad input files and settings end in one line naming the file, line or field (issue #24).

Non-UTF-8 bytes in a prompt/pair/SFT file, a CSV quote that never closes, a float setting
given as NaN or infinity: each must be reported, not read silently nor as a traceback.
"""

import json
import re

import pytest

from rlhflab import models as M
from rlhflab.app.cli import main
from rlhflab.config import ConfigError, load_config
from rlhflab.experience.data import DataError, load_preferences, load_prompts
from rlhflab.trainers.sft import load_sft_pairs

BAD = b"\xff\xfe"  # never valid UTF-8
PAIR = {"prompt": "copy: cat\nanswer:", "chosen": " cat", "rejected": " dog"}


def write_pairs(path, bad_row: int = 3, rows: int = 4) -> None:
    """``rows`` preference pairs in the format of ``path``'s suffix; the rejected answer of
    row ``bad_row`` (1-based, counted as data rows) holds bytes that are not UTF-8."""
    data = [dict(PAIR, rejected=f" dog{i}") for i in range(1, rows + 1)]
    if path.suffix == ".jsonl":
        lines = [json.dumps(r).encode() for r in data]
        lines[bad_row - 1] = lines[bad_row - 1].replace(b"dog", b"dog" + BAD)
        path.write_bytes(b"\n".join(lines) + b"\n")
    elif path.suffix == ".csv":
        lines = [b"prompt,chosen,rejected"] + [f"x{i},a,b{i}".encode() for i in range(rows)]
        lines[bad_row] = lines[bad_row] + BAD  # line 1 is the header
        path.write_bytes(b"\n".join(lines) + b"\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        raw = [r["rejected"].encode() for r in data]
        raw[bad_row - 1] += BAD
        binary = pa.array(raw, type=pa.binary())
        # a string column whose bytes are not UTF-8, as a foreign writer can leave it
        rejected = pa.Array.from_buffers(pa.string(), len(raw), binary.buffers())
        table = pa.table(
            {
                "prompt": [r["prompt"] for r in data],
                "chosen": [r["chosen"] for r in data],
                "rejected": rejected,
            }
        )
        pq.write_table(table, path)


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_non_utf8_bytes_name_the_file_and_line(tmp_path, suffix):
    f = tmp_path / f"pairs{suffix}"
    write_pairs(f)
    # JSONL and CSV count lines as an editor shows them (CSV: the header is line 1)
    line = {".jsonl": 3, ".csv": 4, ".parquet": 3}[suffix]
    with pytest.raises(DataError, match=rf"pairs\{suffix}:{line}: not valid UTF-8"):
        load_preferences(f)


def test_non_utf8_bytes_in_prompt_and_sft_files(tmp_path):
    from rlhflab.models.presets import preset_path

    tok = M.load_tokenizer(preset_path("nano"))
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'{"prompt": "a"}\n{"prompt": "b' + BAD + b'"}\n{"prompt": "c"}\n')
    with pytest.raises(DataError, match=r"p\.jsonl:2: not valid UTF-8"):
        load_prompts(f, tok, 64)
    # one bad line is a bad row like any other: on_bad_row='skip' drops it and goes on
    prompts, report = load_prompts(f, tok, 64, on_bad_row="skip")
    assert prompts == ["a", "c"] and report.skipped == 1
    s = tmp_path / "s.csv"
    s.write_bytes(b"prompt,response\na,b\nc,d" + BAD + b"\n")
    with pytest.raises(DataError, match=r"s\.csv:3: not valid UTF-8"):
        load_sft_pairs(s)


def test_unterminated_csv_quote_names_the_line_it_opened_on(tmp_path):
    f = tmp_path / "pairs.csv"
    # a quoted field may span lines (row 2); the quote opened on line 4 never closes
    f.write_text(
        'prompt,chosen,rejected\nx,a,b\n"two\nlines",a,b\ny,"oops,b\nz,a,b\nw,a,b\n',
        encoding="utf-8",
    )
    with pytest.raises(DataError, match=r"pairs\.csv:5: a quote opened here is never closed"):
        load_preferences(f)
    f.write_text('prompt,chosen,rejected\n"two\nlines",a,"b ""q"""\n', encoding="utf-8")
    (pair,) = load_preferences(f)  # closed quotes, doubled quotes: read as before
    assert pair.prompt == "two\nlines" and pair.rejected == 'b "q"'


def test_a_bad_file_reaches_the_command_as_one_line(tmp_path, monkeypatch, capsys):
    def no_model(*a, **k):
        raise AssertionError("a model was loaded before the data was read")

    monkeypatch.setattr(M, "load_causal_lm", no_model)
    f = tmp_path / "sft.jsonl"
    f.write_bytes(b'{"prompt": "a", "response": "b' + BAD + b'"}\n')
    assert main(["sft", f"sft.data={f}", f"sft.output_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"error: {f}:1: not valid UTF-8 (byte 0xff at column 31)"]
    assert not (tmp_path / "out").exists()


def test_labels_that_are_not_json_name_the_row(tmp_path):
    f = tmp_path / "pairs.csv"
    f.write_text("prompt,chosen,rejected,labels\nx,a,b,{brevity: 1\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"pairs\.csv:2: field 'labels' is not JSON \(got '"):
        load_preferences(f)


def test_a_seed_beyond_what_torch_takes_is_refused_naming_it():
    for seed, said in (("99999999999999999999", "<= 9223372036854775807"), ("-1", ">= 0")):
        with pytest.raises(ConfigError, match=f"^seed: must be {said}"):  # torch overflowed
            load_config(
                overrides=[
                    "reward.functions={'rlhflab.builtin.toy_rewards:cat_reward': 1}",
                    f"seed={seed}",
                ]
            )


@pytest.mark.parametrize(
    "override,field",
    [
        ("ppo.lr=.nan", "ppo.lr"),
        ("ppo.lr=.inf", "ppo.lr"),
        ("ppo.lr=1e400", "ppo.lr"),  # overflows to inf when read
        ("ppo.kl_coef=.inf", "ppo.kl_coef"),
        ("ppo.clip_high=.nan", "ppo.clip_high"),  # float | None
        ("sft.lr=-.inf", "sft.lr"),
        ("rm.heads={preference: .nan}", "rm.heads.preference"),  # dict[str, float] values
        ("reward.functions={'a:b': .inf}", "reward.functions.a:b"),
    ],
)
def test_non_finite_float_settings_are_rejected(override, field):
    with pytest.raises(ConfigError, match=rf"^{field}: must be a finite number"):
        load_config(
            overrides=["reward.functions={'rlhflab.builtin.toy_rewards:cat_reward': 1}", override]
        )


def test_non_finite_float_in_a_yaml_file_is_one_line(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "ppo: {lr: .nan}\nreward: {functions: {'rlhflab.builtin.toy_rewards:cat_reward': 1}}\n"
    )
    assert main(["ppo", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"error: {cfg}: ppo.lr: must be a finite number, got nan"]


def test_a_config_file_that_is_not_utf8_names_the_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(b"seed: 1\nppo:\n  lr: 1.0e-4  # caf\xe9\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:3: not valid UTF-8"):
        load_config(cfg)
    # not YAML: one line with the file's own name and place (PyYAML said "<unicode string>"
    # over several lines); a section the file set to a number is named, not the override
    cfg.write_text("ppo:\n  lr: [1\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:3:1: not valid YAML \(.*from 2:7\)$"):
        load_config(cfg)
    cfg.write_text("sft: 5\n")
    with pytest.raises(ConfigError, match=r"^sft: expected a mapping of settings, got int 5"):
        load_config(cfg, ["sft.examples=20"], stage="sft")


def short_positions(folder, n: int = 16):
    """The nano preset with a position table of ``n``: the built-in task's rows and the
    default answers no longer fit (a GPT-2 or OPT checkpoint has a learned table of this
    kind, and indexing past it fails deep inside the forward)."""
    import shutil

    from rlhflab.models.presets import preset_path

    shutil.copytree(preset_path("nano"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": n}))
    return folder


def test_a_row_longer_than_the_models_positions_is_named_before_it_loads(
    tmp_path, capsys, monkeypatch
):
    """sft, rm and dpo name the first row (file and line, or the built-in example) whose
    prompt + answer + EOS exceed the model's positions; generate and eval the answer
    length that would; all before any weight is loaded, exit status 2."""
    folder = short_positions(tmp_path / "short", 12)
    data = tmp_path / "long.jsonl"
    fits = {"prompt": "a", "response": " b"}
    data.write_text(json.dumps(fits) + "\n" + json.dumps({**fits, "response": " b" * 30}) + "\n")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({**PAIR, "rejected": " dog" * 30}) + "\n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    out = ["device=cpu", f"log.output_dir={tmp_path / 'run'}", f"sft.output_dir={tmp_path / 's'}"]
    policy = f"model.policy={folder}"

    def no_model(*a, **k):
        raise AssertionError("a model was loaded before the data was checked")

    for loader in ("load_causal_lm", "load_sequence_classifier"):
        monkeypatch.setattr(M, loader, no_model)
    for args, said in (
        (["sft", policy, f"sft.data={data}"], f"{data}:2: prompt + 'response' + EOS is"),
        (["sft", policy], "the built-in task's SFT example "),
        (["rm", policy, f"rm.data={pairs}"], f"{pairs}:1: prompt + 'rejected' + EOS is"),
        (["dpo", policy], "the built-in task's pair"),
        (["dpo", policy, f"dpo.data={pairs}"], f"{pairs}:1: prompt + 'rejected'"),
    ):
        assert main([*args, *out]) == 2, args
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert said in line and "over the 12 positions" in line, line
    monkeypatch.undo()
    for args in (
        ["generate", "--model", str(folder), "--prompts", str(tmp_path / "p.jsonl")],
        ["eval", "--model", str(folder), "--out", str(tmp_path / "e.json")],
    ):
        assert main(args) == 2, args
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert "rollout.max_new_tokens:" in line and "exceeds the model's 12 positions" in line
    # what fits runs
    gen = ["generate", "--model", str(folder), "--prompts", str(tmp_path / "p.jsonl")]
    assert main([*gen, "--out", str(tmp_path / "a.jsonl"), "rollout.max_new_tokens=4"]) == 0


@pytest.mark.parametrize(
    "name,text,said",
    [
        ("extra.csv", "prompt,response\nSay hi, politely,Hello\n", ":2: more fields than the header's 2"),
        ("twice.csv", "prompt,response,prompt\na,b,c\n", ":1: column 'prompt' appears twice"),
        ("twice.jsonl", '{"prompt": "a", "response": "b", "response": "c"}\n', ":1: field 'response' appears twice"),
        ("array.json", '[\n {"prompt": "a", "response": "b"}\n]\n', ": a JSON array over several lines"),
    ],
)  # fmt: skip
def test_rows_that_would_lose_or_pick_data_silently_are_named(tmp_path, name, text, said):
    """An unquoted comma (the csv module files the extra field under no column and the row
    loses it), a column or key given twice (the last one would win) and a pretty-printed
    JSON array are errors naming the file and line, not rows read short."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(DataError) as err:
        load_sft_pairs(path)
    assert str(err.value).startswith(f"{path}{said}"), err.value


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path):
    """Spreadsheets' "CSV UTF-8" and some editors start the file with U+FEFF; they also
    leave empty trailing columns and commas, which lose nothing."""
    sheet = tmp_path / "sheet.csv"
    sheet.write_text("prompt,response,,\na, b,,\nc, d,\n")
    assert load_sft_pairs(sheet) == [("a", " b"), ("c", " d")]
    bad = tmp_path / "bad.csv"
    bad.write_bytes(b"\xef\xbb\xbfprompt,response\na,b\xff\n")
    with pytest.raises(
        DataError, match=f"^{re.escape(str(bad))}:2: not valid UTF-8 .* column 4\\)"
    ):
        load_sft_pairs(bad)
    for name, text in (
        ("bom.csv", "prompt,response\na, b\n"),
        ("bom.jsonl", '{"prompt": "a", "response": " b"}\n'),
    ):
        path = tmp_path / name
        path.write_bytes(b"\xef\xbb\xbf" + text.encode())
        assert load_sft_pairs(path) == [("a", " b")], name


def test_an_output_folder_that_is_a_file_and_contradictory_dpo_settings_are_one_line(
    tmp_path, capsys
):
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    for args, said in (
        (["ppo", f"log.output_dir={taken}"], f"log.output_dir: {taken} exists and is not a folder"),
        (["sft", f"sft.output_dir={taken}"], f"sft.output_dir: {taken} exists and is not a folder"),
        (["dpo", "dpo.loss_type=ipo", "dpo.label_smoothing=0.1"], "dpo.label_smoothing: applies"),
    ):
        assert main([*args, "model.policy=preset:nano", "device=cpu"]) == 2, args
        assert said in capsys.readouterr().err.strip().splitlines()[-1]
    assert taken.read_text() == "not a folder"


def test_overrides_outputs_and_weights_that_were_tracebacks_or_silent_are_one_line(
    tmp_path, capsys
):
    """An override that is not YAML (a shell that split an unquoted `{a: 1}`), an override
    into a section a config file left empty, generate/eval writing into a folder or over
    their own prompts, and a negative reward-model loss weight."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    (tmp_path / "adir").mkdir()
    run = tmp_path / "run"  # a run's own files: its log replaced, or a config.json added
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    (run / "metrics.jsonl").write_text('{"iteration": 1}\n')
    gen = ["generate", "--model", "preset:nano", "--prompts", str(prompts)]
    ev = ["eval", "--model", "preset:nano", "--prompts", str(prompts), "--out"]
    owned = "{} is a run or model folder, which reads"
    for args, said in (
        ([*gen, "--out", str(run / "metrics.jsonl")], owned.format(run)),
        ([*ev, str(run / "metrics.json")], owned.format(run)),
        ([*ev, str(run / "config.json")], owned.format(run)),
        (["memory", "ppo.lr=[1"], "override 'ppo.lr=[1': the value is not valid YAML"),
        ([*gen, "--out", str(tmp_path / "adir")], "a folder; name the file to write"),
        ([*gen, "--out", str(prompts)], "the prompt file itself"),
        (["eval", "--model", "preset:nano", "--out", str(tmp_path / "adir")], "a folder"),
        (["rm", "rm.heads={preference: -1}"], "rm.heads: the loss weight of 'preference' is -1"),
    ):
        assert main(args) == 2, args
        assert said in capsys.readouterr().err.strip().splitlines()[-1], args
    assert prompts.read_text() == '{"prompt": "hi"}\n'
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "metrics.jsonl"]
    # a folder that only holds the user's own config.yaml is no run: its names are free
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "config.yaml").write_text("seed: 0\n")
    assert main([*gen, "--out", str(mine / "samples.jsonl"), "rollout.max_new_tokens=2"]) == 0
    assert main([*gen, "--out", str(mine / "samples.jsonl"), "rollout.max_new_tokens=2"]) == 0
    config = tmp_path / "c.yaml"
    config.write_text("ppo:\n  # iterations: 3\n")
    cfg = load_config(config, overrides=["ppo.iterations=1"], stage="sft")
    assert cfg.ppo.iterations == 1


def test_ctrl_c_ends_the_command_with_one_line_and_status_130(monkeypatch, capsys):
    from rlhflab.app import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "memory", interrupted)
    assert main(["memory"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().startswith("interrupted: rlhflab memory")


def test_data_task_picks_the_built_in_skill_everywhere_and_is_checked():
    """data.task was documented but read by nothing: now every built-in stream follows it."""
    from rlhflab.builtin import tasks
    from rlhflab.diagnostics.evaluate import heldout_prompts
    from rlhflab.trainers.common import load_prompt_set
    from rlhflab.trainers.rm import builtin_pairs
    from rlhflab.trainers.sft import builtin_sft_pairs

    cfg = load_config(overrides=["data.task=copy"], reward_given=True)
    texts = load_prompt_set(cfg, None).next_batch()
    texts += [p.prompt for p in builtin_pairs(cfg)]
    texts += [p for p, _ in builtin_sft_pairs(8, 0, tasks.skills_of(cfg.data.task))]
    texts += heldout_prompts(8, 0, cfg.data.task)
    assert texts and all(t.startswith("copy: ") for t in texts), texts[:4]
    mixed = {p.split(":")[0] for p in heldout_prompts(40, 0)}
    assert mixed == {"copy", "reverse", "sort", "add"}
    with pytest.raises(ConfigError, match="data.task"):
        load_config(overrides=["data.task=spelling"], reward_given=True)


@pytest.mark.parametrize(
    "row,said",
    [
        ({**PAIR, "labels": {"brevity": True}}, "field 'labels' must map attributes to numbers"),
        ({**PAIR, "labels": 0}, "field 'labels' must map attributes to numbers"),
        ({**PAIR, "labels": []}, "field 'labels' must map attributes to numbers"),
        ({**PAIR, "rejected": PAIR["chosen"]}, "'chosen' and 'rejected' are the same answer"),
    ],
)
def test_preference_rows_read_as_nothing_or_as_a_number_are_named(tmp_path, row, said):
    """A boolean label was read as 1, a label field of 0 / [] / false as no labels, and a
    pair with one answer twice was trained on: each is now an error naming the row."""
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(PAIR) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=f"^{path}:2: {re.escape(said)}"):
        load_preferences(path)


def test_a_setting_given_twice_in_a_config_file_is_named(tmp_path):
    """PyYAML keeps the last of two equal keys silently: `lr: -5` below `lr: 1e-5` won."""
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  lr: 1.0e-5\n  iterations: 2\n  lr: -5\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}:4: 'lr' is set twice"):
        load_config(path, reward_given=True)
    merged = tmp_path / "m.yaml"  # a YAML merge key may still be overridden
    merged.write_text("ppo:\n  <<: {iterations: 3}\n  iterations: 2\n")
    assert load_config(merged, reward_given=True).ppo.iterations == 2


def test_overrides_on_both_sides_of_an_option_all_count(tmp_path, capsys):
    """`rlhflab ppo --config F seed=1 --resume ppo.lr=1e-5` stopped at "unrecognized
    arguments: ppo.lr=1e-5": argparse takes positionals up to the first option only."""
    config = tmp_path / "c.yaml"
    config.write_text("threads: 1\n")
    vowel = "reward.functions={'rlhflab.builtin.toy_rewards:vowel_reward': 1}"
    args = ["memory", "model.policy=preset:nano", "--config", str(config), vowel]
    assert main(args) == 0
    assert "estimated peak" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:  # argparse's own exit for the unknown
        main(["memory", "--config", str(config), "--bogus"])
    assert stop.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_on_bad_row_skip_drops_and_counts_bad_rows_of_every_stages_data(tmp_path, caplog):
    # it covered data.prompts only: sft.data, rm.data and dpo.data stopped at the first bad
    # row whatever data.on_bad_row said
    import json

    from rlhflab.experience.data import DataError, load_preferences
    from rlhflab.trainers.sft import load_sft_pairs

    sft = tmp_path / "sft.jsonl"
    rows = [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": 3}, {"prompt": "d"}]
    sft.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"sft.jsonl:2: field 'response' must be a non-empty"):
        load_sft_pairs(sft)
    with caplog.at_level("WARNING"):
        assert load_sft_pairs(sft, on_bad_row="skip") == [("a", "b")]
    assert "sft.jsonl: skipped 2 bad rows (first: " in caplog.text and "sft.jsonl:2:" in caplog.text
    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {"prompt": "p", "chosen": "x", "rejected": "x"},
        {"prompt": "p", "chosen": "x", "rejected": "y"},
    ]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match="pairs.jsonl:1: 'chosen' and 'rejected' are the same"):
        load_preferences(pairs)
    caplog.clear()
    with caplog.at_level("WARNING"):
        (kept,) = load_preferences(pairs, on_bad_row="skip")
    assert kept.rejected == "y" and "pairs.jsonl: skipped 1 bad row (first: " in caplog.text
    # every row bad: still an error, not an empty run
    pairs.write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(DataError, match="no preference pairs"):
        load_preferences(pairs, on_bad_row="skip")
