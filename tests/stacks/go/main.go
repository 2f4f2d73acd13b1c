// Stage jobs through drain_stage_v1 with database/sql and lib/pq; see ../README.md for the protocol.
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
		case "stage":
			if tx == nil {
				if tx, err = db.Begin(); err != nil {
					panic(err)
				}
			}
			args, _ := json.Marshal([]string{fields[1]})
			var jobID string
			err = tx.QueryRow(`SELECT drain_stage_v1($1, $2::jsonb, queue => $3)`,
				"tests.support.tasks.record", string(args), queue).Scan(&jobID)
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
		case "bad":
			bad, err := db.Begin()
			if err != nil {
				panic(err)
			}
			var jobID string
			if err := bad.QueryRow(`SELECT drain_stage_v1('')`).Scan(&jobID); err != nil {
				fmt.Println("error", err.Error())
			} else {
				fmt.Println("error none")
			}
			bad.Rollback()
		}
	}
}
