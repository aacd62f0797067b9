"""The columns of the tables that the demo and ``rlhflab compare`` print and the report
draws: one definition for the code that writes them and the code that reads them back."""

# evaluate_policy's keys, per policy (the demo's verdict table)
DEMO_COLUMNS = (
    "gold",
    "proxy",
    "accuracy",
    "kl_to_reference",
    "length",
    "flattery_rate",
    "repetition_rate",
)

# one row per method of `rlhflab compare`
COMPARE_COLUMNS = ("gold", "proxy", "kl_to_reference", "wall_s", "peak_mib", "models")
