from kgen.cli.main import main

main(prog_name="kgen")
