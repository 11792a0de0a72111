"""Memory planner and the `pagedkv plan` CLI, including seed 004's Qwen3-0.6B budget."""
import json
import re
import shutil
import subprocess
import sys

import pytest

from pagedkv.cli import SUBCOMMANDS, main
from pagedkv.config.options import CacheConfig
from pagedkv.config.planner import PlanResult, plan, plan_config
from pagedkv.errors import InvalidArgumentError

# Qwen/Qwen3-0.6B: 28 layers, 16 query heads, 8 KV heads, head_dim 128 (not hidden/heads).
QWEN3_06B = {
    "head_dim": 128,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
}
L, KVH, D = 28, 8, 128
TOKENS = 200_000


def kv_bytes(tokens, elem_bytes, scale_bytes=0):
    """2 (K and V) x layers x kv_heads x (head_dim x elem_bytes + per-head scales) x tokens."""
    return 2 * L * KVH * (D * elem_bytes + scale_bytes) * tokens


def test_seed_004_qwen3_200k_tokens_true_figures():
    fp16 = plan(QWEN3_06B, "64GiB", TOKENS)
    fp8 = plan(QWEN3_06B, "64GiB", TOKENS, kv_dtype="fp8")
    int8 = plan(QWEN3_06B, "64GiB", TOKENS, kv_dtype="int8")
    assert fp16.exact_bytes_per_sequence == kv_bytes(TOKENS, 2)  # 22.9 GB
    assert fp8.exact_bytes_per_sequence == kv_bytes(TOKENS, 1, scale_bytes=4)  # + one float32 scale
    assert int8.exact_bytes_per_sequence == kv_bytes(TOKENS, 1, scale_bytes=8)  # + scale and zero
    # 200,000 is a multiple of 16, so block rounding adds nothing
    assert fp16.bytes_per_sequence == fp16.exact_bytes_per_sequence
    # seed 004 claims a full 200k context stays under 4 GB; the true figures do not:
    four_gb = 4 * 10**9
    assert fp16.exact_bytes_per_sequence > 5 * four_gb
    assert fp8.exact_bytes_per_sequence > 2 * four_gb
    # fp8 storage is ~50% of fp16 (the scales add head_dim/4 bytes in 128)
    assert fp8.bytes_per_token / fp16.bytes_per_token == pytest.approx((128 + 4) / 256)


def test_plan_counts_blocks_tokens_and_sequences():
    r = plan(QWEN3_06B, "4GiB", TOKENS)
    per_token = kv_bytes(1, 2)
    assert r.bytes_per_token == per_token
    assert r.bytes_per_block == 16 * per_token
    assert r.num_blocks == (4 * 1024**3) // (16 * per_token)
    assert r.num_tokens == r.num_blocks * 16
    assert r.arena_bytes == r.num_blocks * r.bytes_per_block <= r.budget_bytes
    assert r.blocks_per_sequence == TOKENS // 16
    assert r.num_sequences == 0  # 4 GiB holds about 37k tokens of Qwen3-0.6B at fp16
    short = plan(QWEN3_06B, "4GiB", 1000)
    assert short.blocks_per_sequence == 63  # ceil(1000 / 16)
    assert short.num_sequences == r.num_blocks // 63


def test_seed_004_short_sequence_under_50_mb():
    # a 100-token sequence takes ceil(100/16) = 7 blocks, far under 50 MB
    r = plan(QWEN3_06B, "4GiB", 100)
    assert r.blocks_per_sequence == 7
    assert r.bytes_per_sequence == 7 * 16 * kv_bytes(1, 2) < 50 * 10**6


def test_plan_config_without_budget_uses_num_blocks():
    c = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=10)
    r = plan_config(c, 40)
    assert r.budget_bytes == r.arena_bytes == c.total_bytes
    assert (r.blocks_per_sequence, r.num_sequences) == (3, 3)
    assert plan_config(c).num_sequences is None
    with pytest.raises(InvalidArgumentError, match=r"max_seq_len: expected an int >= 1, got 0"):
        plan_config(c, 0)


def test_result_format_and_dict():
    r = plan(QWEN3_06B, "4GiB", TOKENS, kv_dtype="fp8")
    text = r.format()
    assert "28 layers, 8 kv heads x 128 head dim (16 attention heads)" in text
    assert "fp8_e4m3 (model dtype float16)" in text
    assert f"{r.bytes_per_token:,} B" in text
    assert f"{r.num_blocks:,}" in text
    assert "0 full-length sequence(s) fit" in text
    assert PlanResult(**r.to_dict()) == r


def _write(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(QWEN3_06B))
    return p


def test_cli_json(tmp_path, capsys):
    p = _write(tmp_path)
    rc = main(["plan", "--model-config", str(p), "--budget", "4GiB", "--max-seq-len", "200000",
               "--kv-dtype", "fp8", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out == plan(QWEN3_06B, "4GiB", TOKENS, kv_dtype="fp8").to_dict()
    assert out["kv_dtype"] == "fp8_e4m3" and out["bytes_per_token"] == kv_bytes(1, 1, 4)


def test_cli_text_and_explicit_shape(capsys):
    rc = main(["plan", "--num-layers", "28", "--num-kv-heads", "8", "--head-dim", "128",
               "--budget", "8GiB", "--max-seq-len", "1000", "--block-size", "32", "--dtype", "bf16"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "bfloat16, block size 32" in out
    assert f"{kv_bytes(1, 2):,} B" in out


@pytest.mark.parametrize(
    "argv,pattern",
    [
        (["--budget", "1GiB"], "expected a path, or all of --num-layers/--num-kv-heads/--head-dim, got neither"),
        (["--budget", "lots", "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8"],
         "memory_budget: expected a byte count"),
        (["--budget", "1KB", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "64"],
         r"memory_budget: expected at least one block \(16384 bytes\), got 1000 bytes"),
        (["--budget", "1GiB", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "64", "--kv-dtype", "fp4"],
         "kv_dtype: expected None"),
    ],
)
def test_cli_errors_exit_2_with_message(argv, pattern, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv plan: error: ")
    assert re.search(pattern, err)


def test_cli_missing_file_is_an_error(tmp_path, capsys):
    assert main(["plan", "--model-config", str(tmp_path / "nope.json"), "--budget", "1GiB"]) == 2
    assert "config: expected a readable config.json" in capsys.readouterr().err


def test_cli_requires_a_subcommand_and_budget(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        main(["plan", "--num-layers", "1"])
    assert "--budget" in capsys.readouterr().err


def test_subcommand_registry_lists_plan():
    assert SUBCOMMANDS["plan"] == "pagedkv.cli.plan"


def test_python_dash_m_entry_point(tmp_path):
    p = _write(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "pagedkv", "plan", "--model-config", str(p), "--budget", "4GiB", "--json"],
        capture_output=True, text=True, check=True,
    )
    assert json.loads(out.stdout)["num_blocks"] == (4 * 1024**3) // (16 * kv_bytes(1, 2))


@pytest.mark.skipif(shutil.which("pagedkv") is None, reason="console script not installed")
def test_console_script(tmp_path):
    p = _write(tmp_path)
    out = subprocess.run(["pagedkv", "plan", "--model-config", str(p), "--budget", "1GiB", "--json"],
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["bytes_per_token"] == kv_bytes(1, 2)


# ---- recurrent-state layers ------------------------------------------------------------------
def _state_config(family):
    from pagedkv.testing.state_models import state_config

    return state_config(family).to_dict()


def test_plan_counts_state_bytes_per_request_for_a_hybrid_model():
    """A Qwen3-Next-like config (Gated DeltaNet, attention, Gated DeltaNet): each
    sequence holds one state (conv [2*2*8 + 4*8, 4] and recurrent [4, 8, 8], float32, in
    both linear layers) at any length, and as much per periodic snapshot; the budget is
    split so that every full-length sequence gets its blocks and its states."""
    c = _state_config("qwen3_next")
    r = plan(c, "64MiB", 1024)
    one = 2 * (64 * 4 + 4 * 8 * 8) * 4
    assert (r.state_layers, r.state_bytes_per_sequence, r.snapshots_per_sequence) == (2, one, 4)
    per_seq = 64 * r.bytes_per_block + 5 * one          # 1024 tokens of blocks, a live state and 4 snapshots
    n = (64 << 20) // per_seq
    assert (r.num_sequences, r.state_slots, r.state_pool_bytes) == (n, 5 * n, 5 * n * one)
    assert r.arena_bytes + r.state_pool_bytes <= 64 << 20
    assert r.num_blocks >= n * 64
    assert "state/sequence  4,096 B" in r.format()
    # a state pool of its own: the KV gets the whole budget, the states what state_budget holds
    r = plan(c, "64MiB", 1024, state_budget="1MiB")
    assert r.state_slots == (1 << 20) // one and r.num_sequences == r.state_slots // 5
    assert r.arena_bytes == r.num_blocks * r.bytes_per_block and r.arena_bytes > (63 << 20)
    assert plan(c, "64MiB", 1024, state_slots=10, state_checkpoint_every=64).num_sequences == 5   # 1 snapshot each
    with pytest.raises(InvalidArgumentError, match="state_budget: expected state_budget or state_slots"):
        plan(c, "64MiB")


def test_plan_a_pure_mamba2_model():
    r = plan(_state_config("mamba2"), "8MiB", 512)
    one = 3 * ((64 + 2 * 8) * 4 + 4 * 16 * 8) * 4       # three Mamba2 layers: conv and SSM states
    assert (r.num_layers, r.attention, r.bytes_per_block, r.state_bytes_per_sequence) == (0, "none", 0, one)
    assert r.num_sequences == (8 << 20) // (3 * one) and r.state_slots == 3 * r.num_sequences


def test_cli_plans_a_hybrid_model(tmp_path, capsys):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(_state_config("bamba")))
    assert main(["plan", "--model-config", str(p), "--budget", "64MiB", "--max-seq-len", "1024",
                 "--state-budget", "2MiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == plan(_state_config("bamba"), "64MiB", 1024, state_budget="2MiB").to_dict()
    assert out["state_bytes_per_sequence"] > 0 and out["state_layers"] == 2
    assert main(["plan", "--model-config", str(p), "--budget", "64MiB"]) == 2
    assert "expected state_budget or state_slots" in capsys.readouterr().err


@pytest.mark.parametrize("group", [64, 128])
def test_cli_fits_qwen3_06b_at_200k_tokens_in_4gb_with_int2(tmp_path, capsys, group):
    """The seed: a full 200k-token context of Qwen3-0.6B (28 layers, 8 KV heads, head_dim
    128) within 4 GB, with int2 (KIVI-2) at block size 64, its window and sinks exact."""
    from pagedkv.format import dtypes

    p = _write(tmp_path)
    rc = main(["plan", "--model-config", str(p), "--budget", "4GB", "--max-seq-len", str(TOKENS),
               "--kv-dtype", "int2", "--block-size", "64", "--kv-group-size", str(group),
               "--kv-window-sequences", "1", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    row, bs = dtypes.info("int2"), 64
    # the format's bytes: codes, a scale and zero per group per (token, head, K or V), and the
    # block keys' bfloat16 scale and zero per (head, channel) per block, as a per-token share
    codes = 2 * L * KVH * D * row.code_bits // 8
    params = 2 * L * KVH * (D // group) * 2 * row.param_bytes
    key_channels = -(-(L * KVH * D * 2 * 2) // bs)
    assert out["bytes_per_token"] == codes + params + key_channels
    assert out["bytes_per_sequence"] == (TOKENS // bs) * bs * out["bytes_per_token"]
    assert out["num_sequences"] >= 1
    assert out["bytes_per_sequence"] + out["window_bytes"] <= out["arena_bytes"] <= 4_000_000_000
    # fp16 needs 22.9 GB for the same context
    assert kv_bytes(TOKENS, 2) > 5 * out["bytes_per_sequence"]
