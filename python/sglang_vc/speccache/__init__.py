"""SpecCache: RAG chunk KV reused at any position, with the tokens to recompute chosen
by a small speculative model ("SpecCache: Speculative KV Cache Reuse for Efficient RAG
Serving"). Built so far: the selection math (:mod:`.spans`), the cross-tokenizer
alignment (:mod:`.align`) and the token selectors behind one interface
(:mod:`.selectors`: ``speccache``, ``cacheblend``, ``epic``, ``random``, ``full-reuse``,
``full-recompute``) and positional recovery (:mod:`.rope`). Not built yet: the chunk KV
store in the tree's tiers, the selective-recompute prefill in the server, the speculative model in the
server, the request API, the RAG workload and its benchmark."""
