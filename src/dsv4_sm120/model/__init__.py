"""--model-impl dsv4: the package's DeepSeek-V4 model class and its resolution."""
