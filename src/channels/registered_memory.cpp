// Placeholder: implemented with issue 5.
