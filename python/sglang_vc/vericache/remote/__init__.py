"""VeriCache's remote prefix caching (``VERICACHE_REMOTE``, paths P1 and P2) and lossless
tiering inside one server: a server drafts from the compressed copy of a stored prefix
while the full KV is verified elsewhere (a local server's ``/generate``) or is still
loading.

* ``worker``: the ``VERICACHE_REMOTE`` speculative worker;
* ``verify``: the remote verifier's client (verify rounds over HTTP);
* ``stream``: the full copy streamed from storage (P2) and the per-request path choice;
* ``tiering``: drafts from the compressed copy while this server's full copy loads;
* ``spec``: the algorithm's registration and server-argument resolution;
* ``model``: appendix B.2's model of the routes (P1, P2, the baselines).

The long-context decoding path (``vericache/worker.py`` and its modules) does not import
this package.
"""
