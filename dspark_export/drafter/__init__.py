"""The DSpark drafter: its config and torch model, training data and target features, training, the
pipeline that runs them, and its export to the `dspark_draft` graph."""
