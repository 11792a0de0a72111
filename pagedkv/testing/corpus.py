"""The text the quality tests and benchmarks read, and who reads which part of it.

The corpus is CPython's own help text: ``pydoc_data.topics.topics`` (the pages
``help("if")`` shows), joined in sorted key order with blank lines, tokenized without
special tokens. It ships with every CPython, needs no download, and is technical English
with code, the kind of text a model serving developers sees. It changes between Python
versions, so figures name the version they were measured with (3.11: 113,108 SmolLM2
tokens).

Token ranges below are in SmolLM2 tokens. A held-out slice is text that no test, no
calibration and no tuning reads: the quality goals are judged there. Who reads what:

============================  ==================================================================
tokens                        read by
============================  ==================================================================
0 - 8,191                     ``benchmarks/kv_quality.py --slices issue11`` (the issue-11 protocol);
                              ``tests/model_fixtures.perplexity_ids`` (0 - 4,095); vLLM tests
8,192 - 11,191                the benchmark's greedy prompts (5 x 512, 600 apart)
11,392 - 11,903               the calibration text of issue 11 (512 tokens)
12,000 - 14,047               :data:`TEST_SLICE`: ``tests/test_kv_quality.py`` (validation of the
                              calibration's choice; goals checked in tests)
14,336 - 18,431               :data:`DEV_SLICE`: where int4's layout was tuned (issue 33)
20,000 - 21,900, 30,000 -     vLLM tests and ``benchmarks/vllm_connector.py`` (speed, not quality)
74,800, 90,000 - 90,063
:data:`CALIBRATION` pieces    :func:`pagedkv.tools.calibration.calibrate` in tests and benchmarks
:data:`HELD_OUT` slices       only the held-out report of ``benchmarks/kv_quality.py``
============================  ==================================================================
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from pagedkv.errors import InvalidArgumentError, expected

__all__ = ["CALIBRATION", "DEV_SLICE", "HELD_OUT", "TEST_SLICE", "calibration_texts", "corpus_ids", "text_ids"]

#: eight 512-token pieces from four parts of the corpus (start tokens), for calibrate()
CALIBRATION = (22_528, 24_576, 26_624, 28_672, 86_016, 88_064, 107_520, 109_568)
CALIBRATION_TOKENS = 512
#: held-out slices ``name -> (start, tokens)``: read only by the benchmark's report
HELD_OUT = {"A": (76_800, 8_192), "B": (94_208, 8_192)}
#: where the tests check goals and a calibration's choice (never calibrated on)
TEST_SLICE = (12_000, 2_048)
#: where int4's layout was chosen (issue 33): neither held out nor calibration text
DEV_SLICE = (14_336, 4_096)


def _text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


@functools.lru_cache(maxsize=4)
def _ids(tokenizer: Any) -> tuple[int, ...]:
    return tuple(int(i) for i in tokenizer(_text(), add_special_tokens=False)["input_ids"])


def corpus_ids(tokenizer: Any) -> tuple[int, ...]:
    """Every token of the corpus (cached per tokenizer)."""
    return _ids(tokenizer)


def text_ids(tokenizer: Any, n: int, start: int = 0) -> torch.Tensor:
    """``[1, n]`` int64: tokens ``[start, start + n)`` of the corpus. Raises
    :class:`~pagedkv.errors.InvalidArgumentError` when the corpus is shorter."""
    ids = _ids(tokenizer)
    if start < 0 or n < 1 or start + n > len(ids):
        raise InvalidArgumentError(expected("start, n", f"a range within the corpus's {len(ids)} tokens",
                                            (start, n)))
    return torch.tensor([ids[start:start + n]], dtype=torch.long)


def calibration_texts(tokenizer: Any, pieces: int = len(CALIBRATION),
                      tokens: int = CALIBRATION_TOKENS) -> list[torch.Tensor]:
    """The first ``pieces`` calibration pieces of ``tokens`` tokens each."""
    return [text_ids(tokenizer, tokens, start=s) for s in CALIBRATION[:pieces]]
