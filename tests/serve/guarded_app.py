"""Constants of the guarded tiny application (tests/serve/conftest.py `guarded`)."""

NAME = "guarded"
PREFIX = f"/{NAME}"
API_KEY, ADMIN_KEY = "user-key-for-tests", "admin-key-for-tests"
MAX_NUM_SEQS, QUEUED = 2, 2
CAPACITY = MAX_NUM_SEQS + QUEUED
"""Requests the one attention rank may hold: `max_num_seqs` + `max_queued_per_rank`."""
MAX_TOKENS = 24
BODY_TIMEOUT_S = 3.0
"""`ingress.body_timeout_s`: an admitted request's body must arrive within it."""
ENGINE_ARGS = {"enable_prefix_caching": True, "max_num_batched_tokens": 512, "seed": 7}
"""`attention.engine_args` of the app (tests/serve/test_engine_args_app.py)."""
KV_CACHE_GIB = 0.125
USER = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
