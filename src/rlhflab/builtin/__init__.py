"""The built-in task: verifiable prompts, their gold reward, the noisy teacher and annotator, toy rewards."""
