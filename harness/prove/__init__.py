"""The proofs tier over ``overlap_spec.proofs``: ``tier`` (jobs, JSON, table, the part
``check`` runs) and ``cli`` (``overlap-spec prove``).
"""
