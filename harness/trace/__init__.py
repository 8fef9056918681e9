"""One trace format for every implementation: ``format`` (schema and parser), ``codec``
(values to JSON and back), ``record`` (any model, through its happens-before record),
``gpu`` (gpu_impl's race detector as a recorder), ``shim`` (a live SGLang scheduler),
``check`` (the spec's verdict on a trace), ``render`` (Mermaid/SVG) and ``cli``.
"""
