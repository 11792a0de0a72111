"""Layer groups of hybrid models: which layers share a block table (``layers``), the
coordinator that fans table calls out to each group (``tables``) and their data views (``data``)."""
