"""Grading the assignment: the rubric, problem-by-problem isolation of a submission, the pytest plugin."""
