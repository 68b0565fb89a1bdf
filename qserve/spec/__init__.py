"""What a user asks for, typed once: the recipe (pydantic models over YAML), the gate spec and its one
parser, and lm-eval's options for both models. Below checkpoint/, so a manifest holds the recipe in this
form and the spec travels typed from the recipe to serve."""
