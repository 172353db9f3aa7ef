"""Planning passes: each takes what the pass before produced and returns what the next needs."""
