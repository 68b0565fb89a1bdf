"""The accuracy gate: statistics, error spending, policy, decisions, looks, levels, external runs, the
record and the model card that shows it."""
