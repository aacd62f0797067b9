"""A reward function for the quickstart (docs/quickstart.md): prompts and answers in, one
float per answer out."""


def concise_and_polite(prompts, responses):
    return [
        (1.0 if "please" in r.lower() or "thank" in r.lower() else 0.0) - 0.01 * len(r.split())
        for r in responses
    ]
