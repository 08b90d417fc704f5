"""The distilled draft: its model (model.py, model_type mirror_distilled) and the finder that lets mlx-lm load
it by that name (model_types.py)."""
