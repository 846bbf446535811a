"""One-off studies behind one BENCHMARKS.md section each: retrieval heads (``needle_heads``), Token Sparse on the
needle (``needle_token_sparse``), POD units ranked by pass-key gain (``retrieval_units``), POD's gate skip
(``pod_gate_skip``), learning curves of several runs (``learning_curves``). They may import eval's shared modules
and the product (eval/harness/); nothing imports them. The rules of eval's rooms: ARCHITECTURE.md, "eval".
"""
