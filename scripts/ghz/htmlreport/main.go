// Command ghz-html renders ghz JSON reports as ghz's own HTML report, so that one load run
// gives both (ghz writes a single output format per run). For each REPORT.json argument it
// writes REPORT.html beside it.
//
// Usage: ghz-html REPORT.json...
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"

	"github.com/bojand/ghz/printer"
	"github.com/bojand/ghz/runner"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: ghz-html REPORT.json...")
		os.Exit(2)
	}
	for _, path := range os.Args[1:] {
		if err := render(path); err != nil {
			fmt.Fprintf(os.Stderr, "ghz-html: %s: %v\n", path, err)
			os.Exit(1)
		}
	}
}

func render(path string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var report runner.Report
	if err := json.Unmarshal(data, &report); err != nil {
		return err
	}
	out, err := os.Create(strings.TrimSuffix(path, ".json") + ".html")
	if err != nil {
		return err
	}
	p := printer.ReportPrinter{Out: out, Report: &report}
	if err := p.Print("html"); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
