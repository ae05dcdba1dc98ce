"""The default image model's workshop: the shapes world, its judge, training and
evaluation (NOTES.md has the runs behind the shipped weights)."""
