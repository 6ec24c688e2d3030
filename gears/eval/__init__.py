"""Evaluation of a trained model: predictions, scores (cell-eval, the Virtual Cell Challenge
2026), baselines, count sampling, the run's report and plots."""
