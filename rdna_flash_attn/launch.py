"""`python -m rdna_flash_attn.launch [options] script.py [arguments...]`: the trainers' launcher
(integrations/launch.py), kept at this short name that users put in their training commands."""

from .integrations.launch import main

if __name__ == "__main__":
    main()
