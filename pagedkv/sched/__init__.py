"""Scheduling helpers an engine drives: chunked prefill with progress, cancellation and
resume (``prefill``) and the chunk planner (``chunking``)."""
