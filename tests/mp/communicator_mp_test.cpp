// Placeholder: tests come with issue 5.
