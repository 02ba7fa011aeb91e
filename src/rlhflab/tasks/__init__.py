"""Tasks: prompts, demonstrations, preference pairs and a gold reward."""
