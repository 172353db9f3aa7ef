"""What a plan shows a person: its table, its predicted timelines and trace events."""
