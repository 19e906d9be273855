from pystronghold.cli import run

run()
