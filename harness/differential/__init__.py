"""gpu_impl against the reference: ``compare`` runs one script on both and compares
every observation; ``tier`` runs it over the cells (``overlap-spec diff``).
"""
