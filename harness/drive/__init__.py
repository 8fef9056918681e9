"""Driving a model against the spec: the invariant checker every run feeds
(``checker``), operation scripts and their replay (``script``), the Hypothesis state
machine over them (``stateful``), and the one cell selector and default seed (``cells``).
"""
