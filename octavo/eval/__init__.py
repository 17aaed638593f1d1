"""Evaluation: the project's offline text (calibration and evaluation parts) and perplexity."""
