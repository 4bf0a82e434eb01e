"""`python -m jaxrl.bench --compare trl`: the commands each side runs, their interleaving, and the
per-point ratio and memory (the child processes are faked; the real ones take minutes)."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from jaxrl import bench
from jaxrl.bench import compare


def test_dpo_runs_trls_objective_on_both_sides():
    cmds = bench.compare_commands("dpo", ("llama-4x256", 8, 512), 5, 2, ["--seed", "3"])
    assert list(cmds) == ["dpo", "dpo prefix_sharing"]
    jaxrl_cmd, trl_cmd = cmds["dpo"]
    flags = dict(zip(jaxrl_cmd[3::2], jaxrl_cmd[4::2], strict=False))
    assert flags["--loss_type"] == "sigmoid" and flags["--loss_weights"] == "null"
    assert flags["--prefix_sharing"] == "false" and flags["--max_prompt_length"] == "256"
    assert flags["--bf16"] == "false" and flags["--seed"] == "3"
    assert cmds["dpo prefix_sharing"][0][-3:] == ["true", "--seed", "3"]
    assert trl_cmd[1].endswith("examples/bench_trl.py")
    assert trl_cmd[trl_cmd.index("--seq_len") + 1] == "512"
    assert trl_cmd[trl_cmd.index("--batch") + 1] == "8"
    assert "--bf16" not in trl_cmd  # f32 on both sides unless asked


def test_precision_flags_reach_both_sides():
    extra = ["--bf16", "true", "--gradient_checkpointing=true"]
    jaxrl_cmd, trl_cmd = bench.compare_commands("sft", ("qwen2.5-0.5b", 8, 1024), 5, 2, extra)[
        "sft"
    ]
    assert jaxrl_cmd[-3:] == extra  # the later flags win over the f32 defaults
    assert "--bf16" in trl_cmd and "--gradient_checkpointing" in trl_cmd


def test_sweep_interleaves_sides_and_reports_ratio_and_rss(monkeypatch, capsys):
    calls = []

    # As if this process had been re-executed with jaxrl's malloc tunable (jaxrl/_malloc.py).
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    monkeypatch.setenv("JAXRL_HUGEPAGE_MALLOC", "added")
    monkeypatch.setenv("PYTHONPATH", "/user/site")

    def fake_child(cmd, env=None):
        side = "trl" if "bench_trl.py" in cmd[1] else "jaxrl"
        calls.append(side)
        # jaxrl's children inherit the tunable; TRL's run in the user's environment.
        assert (env is None) == (side == "jaxrl")
        assert side == "jaxrl" or "GLIBC_TUNABLES" not in env
        # TRL's script imports jaxrl: the checkout is on its path (a source checkout is not
        # installed), ahead of the user's PYTHONPATH.
        root = str(Path(bench.__file__).resolve().parents[2])
        assert side == "jaxrl" or env["PYTHONPATH"] == os.pathsep.join((root, "/user/site"))
        step = {"jaxrl": 0.5, "trl": 1.0}[side]
        return {"step_s": step + 0.01 * len(calls), "peak_rss_bytes": {"jaxrl": 3, "trl": 2}[side]}

    monkeypatch.setattr(compare, "run_child", fake_child)
    assert bench.main(["--algo", "sft", "--compare", "trl", "--sweep", "--reps", "2"]) == 0
    assert calls == ["jaxrl", "trl"] * 2 * len(bench.SWEEP)
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["preset"], r["batch"], r["seq_len"]) for r in rows] == list(bench.SWEEP)
    first = rows[0]
    assert first["jaxrl_step_s_all"] == pytest.approx([0.51, 0.53])
    assert first["speed_ratio"] == pytest.approx(1.03 / 0.52)
    assert (first["jaxrl_peak_rss_bytes"], first["trl_peak_rss_bytes"]) == (3, 2)


def test_compare_errors(capsys):
    assert bench.main(["--compare", "torch", "--sweep"]) == 2
    assert bench.main(["--algo", "reward", "--compare", "trl", "--sweep"]) == 2
    assert bench.main(["--algo", "sft", "--compare", "trl"]) == 2
    err = capsys.readouterr().err
    assert "only `--compare trl`" in err and "sft and dpo" in err and "--preset NAME" in err


def test_longtail_lengths_run_static_and_bucketed_jaxrl_against_trl():
    """`--lengths longtail`: both sides get the flag (the same rows, in order); jaxrl also runs
    with one static row length (`--length_buckets null`, its behaviour before buckets), and
    both sides padding-free."""
    cmds = bench.compare_commands("sft", ("llama-4x256", 8, 1024), 5, 2, [], "longtail")
    assert list(cmds) == ["sft", "sft static", "sft padding_free"]
    for jaxrl_cmd, trl_cmd in cmds.values():
        for cmd in (jaxrl_cmd, trl_cmd):
            assert cmd[cmd.index("--lengths") + 1] == "longtail"
    assert "--length_buckets" not in cmds["sft"][0]
    static = cmds["sft static"][0]
    assert static[static.index("--length_buckets") + 1] == "null"
    pf_jaxrl, pf_trl = cmds["sft padding_free"]
    assert pf_jaxrl[pf_jaxrl.index("--padding_free") + 1] == "true" and "--padding_free" in pf_trl
    assert "--padding_free" not in cmds["sft"][1]
    dpo = bench.compare_commands("dpo", ("llama-4x256", 8, 512), 5, 2, [], "longtail")
    assert list(dpo) == ["dpo", "dpo prefix_sharing", "dpo static"]


def test_long_tail_lengths():
    lengths = bench.long_tail_lengths(4000, 1024, seed=0)
    assert lengths == bench.long_tail_lengths(4000, 1024, seed=0)  # both sides draw alike
    assert min(lengths) >= 8 and max(lengths) == 1024
    assert 140 < np.median(lengths) < 200  # median about 1024 / 6
    assert 0.003 < np.mean(np.asarray(lengths) == 1024) < 0.03  # the tail cut at the cap
