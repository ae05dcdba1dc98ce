"""The default formula model's workshop: data, synthetic and LaTeX-rendered strips,
tokenizer, training and evaluation (NOTES.md has the runs behind the shipped weights)."""
