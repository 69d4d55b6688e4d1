"""pt-ray: PipeTransformer (ICML 2021) rebuilt as a Ray service."""
