"""Grammar-constrained decoding: request specs, the compile worker + cache, per-request matchers, masks.

The narrow interface the scheduler uses:
- ``GrammarSpec.parse(raw)``: a request's grammar (json_object / json_schema / regex / choice / lark);
- ``GrammarCompiler``: compiles off the tick loop (a worker thread, a bounded cache keyed by the
  grammar text) and hands each request its own ``GrammarState``;
- ``masks.constrain``: fills the mask of each constrained row and applies it to the logits.
"""
