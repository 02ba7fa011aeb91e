"""RLHF algorithm building blocks: pure tensor functions (see ``functional``)."""
