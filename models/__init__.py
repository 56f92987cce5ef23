"""The model zoo, installed as `moetrain.models` (setup.py maps this folder there, so no top-level
`models` package collides with a user's). Every module here is imported by `moetrain.registry` and
registers its families; adding a model is adding one folder (or file)."""
