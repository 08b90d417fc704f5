"""The distilled draft: its model (model.py, model_type mirror_distilled) and its loading through mlx-lm's
get_model_classes hook (model_types.py)."""
