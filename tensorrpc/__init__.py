"""tensorrpc."""
