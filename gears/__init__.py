"""GEARS perturbation-response models: fast data layer, model, and one training engine."""
