"""Building and loading models through from_pretrained."""
