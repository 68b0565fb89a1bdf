"""The files qserve writes into a checkpoint beside the model's own, and which of them are records.

qserve's own records beside the weights, rewritten by eval and serve, are the only files a
manifest does not hash. Everything else (weights, configs, tokenizer, templates, code, .bin/.pt
files) is hashed, and an added, removed or changed file is refused.
"""

MANIFEST_NAME = "qserve_manifest.json"
EVAL_NAME = "qserve_eval.json"
LM_EVAL_RESULTS_NAME = "lm_eval_results.json"
CARD_NAME = "README.md"  # the model card (qserve writes it; eval rewrites it with results)
REPORT_NAME = "qserve_eval.md"
SIGNATURE_NAME = "qserve_signature.sig"  # `qserve sign`: a sigstore bundle over everything else
ITEMS_NAME = "qserve_eval_items.json"  # a limited eval's per-item values, which a larger --limit continues
RECORD_NAMES = {MANIFEST_NAME, EVAL_NAME, LM_EVAL_RESULTS_NAME, CARD_NAME, REPORT_NAME, SIGNATURE_NAME, ITEMS_NAME}
RECORD_DIRS = {"logs"}  # <checkpoint>/logs/serve.log
