"""Layer groups of hybrid models: each group's spec (its attention type, block geometry
and format: ``spec``), which layers share a block table (``layers``), the coordinator
that fans table calls out to each group (``tables``) and their data views (``data``)."""
