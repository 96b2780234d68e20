// Placeholder: written with issue 5.
int main() { return 1; }
