// Stage jobs through drain_stage_v1 and drain_stage_v2 with database/sql and lib/pq; see ../README.md for the protocol.
package main

import (
	"bufio"
	"database/sql"
	"encoding/json"
	"fmt"
	"os"
	"strings"

	_ "github.com/lib/pq"
)

func main() {
	dsn, queue := os.Args[1], os.Args[2]
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		panic(err)
	}
	defer db.Close()
	var tx *sql.Tx
	scanner := bufio.NewScanner(os.Stdin)
	for scanner.Scan() {
		fields := strings.Fields(scanner.Text())
		if len(fields) == 0 {
			continue
		}
		switch fields[0] {
		case "stage", "stage-keyed":
			if tx == nil {
				if tx, err = db.Begin(); err != nil {
					panic(err)
				}
			}
			args, _ := json.Marshal([]string{fields[1]})
			var jobID string
			if fields[0] == "stage" {
				err = tx.QueryRow(`SELECT drain_stage_v1($1, $2::jsonb, queue => $3)`,
					"tests.support.tasks.record", string(args), queue).Scan(&jobID)
			} else {
				err = tx.QueryRow(`SELECT drain_stage_v2($1, $2::jsonb, queue => $3, ordering_key => $4)`,
					"tests.support.tasks.record", string(args), queue, fields[2]).Scan(&jobID)
			}
			if err != nil {
				panic(err)
			}
			fmt.Println("staged", jobID)
		case "commit", "rollback":
			if fields[0] == "commit" {
				err = tx.Commit()
			} else {
				err = tx.Rollback()
			}
			if err != nil {
				panic(err)
			}
			tx = nil
			fmt.Println("ok")
		case "bad", "bad-key":
			bad, err := db.Begin()
			if err != nil {
				panic(err)
			}
			call := `SELECT drain_stage_v1('')`
			if fields[0] == "bad-key" {
				call = `SELECT drain_stage_v2('a.b', ordering_key => '')`
			}
			var jobID string
			if err := bad.QueryRow(call).Scan(&jobID); err != nil {
				fmt.Println("error", err.Error())
			} else {
				fmt.Println("error none")
			}
			bad.Rollback()
		}
	}
}
